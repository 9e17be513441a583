"""A checkpoint's tokenizer, as ``transformers.AutoTokenizer`` would load it.

``AutoTokenizer`` imports transformers' configuration machinery, which imports torch: seconds of
start-up for a gateway that never computes a tensor.  Where the checkpoint names the generic
class (``tokenizer_class`` ``TokenizersBackend`` or ``PreTrainedTokenizerFast`` in
``tokenizer_config.json``) and ships ``tokenizer.json``, ``AutoTokenizer`` would pick exactly
that class, so it is loaded directly; a model-specific class (``GemmaTokenizer``, ...) may rebuild
its pipeline in its own constructor and goes through ``AutoTokenizer``.
"""
from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_class_name(checkpoint: Path) -> str | None:
    """The ``tokenizer_class`` the checkpoint names, if it names one."""
    try:
        config = json.loads((Path(checkpoint) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def load_tokenizer(checkpoint: Path):
    """The tokenizer of the Hugging Face directory ``checkpoint`` (raises as ``AutoTokenizer`` does)."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "tokenizer.json").is_file() and tokenizer_class_name(checkpoint) in GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(checkpoint)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
