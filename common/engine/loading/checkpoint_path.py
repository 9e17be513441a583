"""Where a ``model`` setting's checkpoint lies on disk (without loading torch: the gateway reads the
tokenizer and config from it)."""
from __future__ import annotations

from pathlib import Path


def resolve_checkpoint(model: str) -> Path:
    """Turn the ``model`` setting into a Hugging Face directory: ``default`` is the bundled Gemma 3
    270M, ``hf:ORG/NAME[@REVISION]`` is downloaded once from the Hub (``common.engine.loading.hub``), a
    ``.gguf`` file is converted once into a cached directory (never next to the file, which may be
    on a read-only mount)."""
    if model == "default":
        from common.engine.loading.default_model import ensure_default_model

        return ensure_default_model()
    if model.startswith("hf:"):
        from common.engine.loading.default_model import default_cache_dir
        from common.engine.loading.hub import hub_checkpoint

        return hub_checkpoint(model, default_cache_dir())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from common.engine.loading.default_model import converted_gguf_dir

        return converted_gguf_dir(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is neither a directory nor a .gguf file")
    return path
