"""Quantized weights packed once per checkpoint and kept in the project cache, so a worker that
starts again on the same checkpoint and settings (on CPU) reads its packed weights instead of quantizing
and repacking every product (on Gemma 3 270M, int8: ~2 s of a 2.4 s load; the work grows with
the model).

One file per (checkpoint, scheme, group size, dtype, tensor-parallel rank) under
``<cache>/prepacked/`` (``<cache>``: ``default_cache_dir``), a safetensors file -- tensors only, no
pickle -- whose metadata describes each weight (``QuantizedWeight.describe``).  Its name ends in a
key over everything its bytes depend on: the checkpoint's files (names, sizes, modification
times), the settings, torch's version, the CPU's instruction set and ``PREPACK_VERSION``; when any
of them changes the key does, the file is packed again and the stale one of the same prefix goes.
Entries of checkpoints that no longer exist are removed as files are written.  A file that cannot
be read, or whose weights are not this model's, is a miss (logged): the load quantizes as if there
were no cache.  A cache directory that cannot be written costs only the saving.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from common.engine.models.quantization_scheme import Quantization
from common.engine.models.quantized import QuantizedWeight, restore_weight

log = logging.getLogger(__name__)

# Bump when a packed layout changes (``common.engine.models.quantized``): older files become misses.
PREPACK_VERSION = 1
DIRECTORY = "prepacked"
_METADATA_KEY = "pdserve_prepacked"
_SUFFIX = ".safetensors"
_PARTIAL = ".prepacking-"  # a file being written
PARTIAL_MAX_AGE_S = 3600.0  # older, its writer is gone


def _checkpoint_files(checkpoint: Path) -> list[list]:
    """What identifies a checkpoint's contents without reading them: each weight, config and
    blocks file's name, size and modification time (a GGUF's blocks lie a folder down)."""
    files = []
    for path in sorted([*checkpoint.glob("*"), *checkpoint.glob("*/*.safetensors")]):
        if path.is_file() and path.suffix in (".safetensors", ".json"):
            stat = path.stat()
            files.append([str(path.relative_to(checkpoint)), stat.st_size, stat.st_mtime_ns])
    return files


class PrepackCache:
    """The cache file of one checkpoint under one set of settings (see the module docstring)."""

    def __init__(self, path: Path, checkpoint: Path):
        self.path = path
        self.checkpoint = checkpoint

    @classmethod
    def for_checkpoint(cls, checkpoint: Path, quantization: Quantization, dtype: torch.dtype, tp_rank: int = 0,
                       tp_size: int = 1) -> "PrepackCache":
        from common.engine.loading.default_model import default_cache_dir

        checkpoint = Path(checkpoint).resolve()
        dtype_name = str(dtype).removeprefix("torch.")
        identity = {
            "version": PREPACK_VERSION, "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(), "files": _checkpoint_files(checkpoint),
            "scheme": quantization.scheme, "group_size": quantization.group_size, "dtype": dtype_name,
            "tp": [tp_rank, tp_size],
        }
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
        where = hashlib.sha256(str(checkpoint).encode()).hexdigest()[:12]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", checkpoint.name)[:64]
        prefix = (f"{name}-{where}-{quantization.scheme}-g{quantization.group_size}-{dtype_name}"
                  f"-tp{tp_rank}of{tp_size}")
        return cls(default_cache_dir() / DIRECTORY / f"{prefix}-{key}{_SUFFIX}", checkpoint)

    @property
    def _prefix(self) -> str:
        return self.path.name.rsplit("-", 1)[0]

    def load(self) -> dict[str, QuantizedWeight] | None:
        """The weights saved by ``save``, or None (no file, or one that cannot be used: logged)."""
        if not self.path.is_file():
            return None
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(self.path, framework="pt") as f:
                described = json.loads((f.metadata() or {})[_METADATA_KEY])["weights"]
                parts: dict[str, dict[str, torch.Tensor]] = {}
                for key in f.keys():
                    name, _, part = key.rpartition("/")
                    parts.setdefault(name, {})[part] = f.get_tensor(key)
            weights = {name: restore_weight(description, parts.get(name, {})) for name, description in described.items()}
        except (SafetensorError, OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # RuntimeError: torch could not map the file (another process removed it meanwhile)
            log.warning("prepacked weights %s unusable, quantizing again: %s: %s", self.path.name,
                        type(exc).__name__, exc)
            return None
        log.info("quantized weights read prepacked from %s (%d weights)", self.path, len(weights))
        return weights

    def save(self, weights: dict[str, QuantizedWeight]) -> None:
        """Write ``weights`` (a model's ``quantized_weights()``) atomically, then remove this
        checkpoint's stale files and those of checkpoints that are gone; a failure is logged."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors = {f"{name}/{part}": tensor.detach().contiguous().cpu()
                   for name, weight in weights.items() for part, tensor in weight.packed_tensors().items()}
        described = {name: weight.describe() for name, weight in weights.items()}
        metadata = {_METADATA_KEY: json.dumps({"checkpoint": str(self.checkpoint), "weights": described})}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=_PARTIAL, suffix=_SUFFIX)
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata=metadata)
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
            log.warning("could not keep the prepacked weights in %s: %s", self.path.parent, exc)
            return
        log.info("quantized weights prepacked into %s (%.1f MiB)", self.path, self.path.stat().st_size / 2**20)
        self._remove_stale()

    def _remove_stale(self) -> None:
        from safetensors import SafetensorError, safe_open

        for other in self.path.parent.glob(f"*{_SUFFIX}"):
            if other == self.path:
                continue
            if other.name.startswith(_PARTIAL):  # another process writing, unless it died doing so
                _remove_if(other, _age_s(other) > PARTIAL_MAX_AGE_S)
                continue
            stale = other.name.rsplit("-", 1)[0] == self._prefix
            if not stale:
                try:
                    with safe_open(other, framework="pt") as f:
                        checkpoint = json.loads((f.metadata() or {})[_METADATA_KEY])["checkpoint"]
                    stale = not Path(checkpoint).is_dir()
                except (SafetensorError, OSError, RuntimeError, ValueError, KeyError, TypeError):
                    # unreadable (or removed by another process meanwhile): nothing can use it
                    stale = True
            _remove_if(other, stale)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _remove_if(path: Path, condition: bool) -> None:
    if condition:
        try:
            path.unlink()
        except OSError:
            pass

