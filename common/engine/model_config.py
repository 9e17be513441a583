"""The model facts the engine needs, derived once from a Hugging Face config.

Deriving them means importing transformers (~3 s of CPU per process) for its config classes,
whose defaults fill what a config.json leaves out. ``load_model_config`` does that once per
config.json and transformers version and keeps the result as JSON in the cache directory, so a
worker that restarts, or the fifth worker of a pool, starts without importing transformers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Bump when ModelConfig's fields or their derivation change, so cached entries are not reused.
CONFIG_CACHE_VERSION = 1

# model_type -> (qkv bias, o bias, q/k norm, Gemma-style sandwich norms)
_ARCHITECTURES: dict[str, tuple[bool, bool, bool, bool]] = {
    "llama": (False, False, False, False),
    "mistral": (False, False, False, False),
    "qwen2": (True, False, False, False),
    "qwen3": (False, False, True, False),
    "gemma3_text": (False, False, True, True),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_ARCHITECTURES))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family or Gemma 3 decoder, with per-layer attention details."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sandwich_norms: bool  # Gemma: norms after attention and after the MLP too
    norm_weight_offset: float  # Gemma's RMSNorm scales by (1 + w)
    embed_scale: float
    attn_scale: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # per layer: "full_attention" or "sliding_attention"
    sliding_window: int | None
    final_logit_softcapping: float | None
    eos_token_ids: tuple[int, ...]
    # layer type -> (rotary inverse frequencies, attention scaling), as transformers computes them
    rope: dict[str, tuple[tuple[float, ...], float]]

    def window(self, layer: int) -> int | None:
        """Tokens a query at position p may see in this layer (p itself included), or None for all."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_config(cls, hf: Any) -> "ModelConfig":
        from common.engine.models.rotary import rope_tables

        model_type = hf.model_type
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        qkv_bias, o_bias, qk_norm, sandwich = _ARCHITECTURES[model_type]
        if getattr(hf, "attn_logit_softcapping", None):  # Gemma 3 checkpoints leave it unset
            raise ValueError(f"attention logit softcapping (attn_logit_softcapping={hf.attn_logit_softcapping}) "
                             "is not supported by the attention backends")
        if model_type in ("llama", "mistral"):
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        is_gemma = model_type == "gemma3_text"
        num_layers = hf.num_hidden_layers
        sliding_window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        if layer_types is None:
            kind = "sliding_attention" if sliding_window else "full_attention"
            layer_types = [kind] * num_layers
        if "sliding_attention" not in layer_types:
            sliding_window = None
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=num_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_model_len=hf.max_position_embeddings,
            hidden_act=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            sandwich_norms=sandwich,
            norm_weight_offset=1.0 if is_gemma else 0.0,
            embed_scale=hf.hidden_size**0.5 if is_gemma else 1.0,
            attn_scale=(hf.query_pre_attn_scalar if is_gemma else head_dim) ** -0.5,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
            eos_token_ids=eos_ids,
            rope=rope_tables(hf, head_dim, tuple(layer_types)),
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ModelConfig":
        """The inverse of ``to_json``; KeyError/TypeError/ValueError on anything else."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) != fields:
            raise KeyError(f"fields differ: {sorted(set(data) ^ fields)}")
        return cls(**{
            **data,
            "layer_types": tuple(data["layer_types"]),
            "eos_token_ids": tuple(data["eos_token_ids"]),
            "rope": {t: (tuple(float(f) for f in freqs), float(scaling)) for t, (freqs, scaling) in data["rope"].items()},
        })


def load_hf_config(checkpoint: Path):
    """The transformers config of ``checkpoint`` (its text config for a multimodal one)."""
    from transformers import AutoConfig

    config_file = checkpoint / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no config.json")
    try:
        json.loads(config_file.read_text())
        hf = AutoConfig.from_pretrained(checkpoint)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has an unreadable config.json: {exc}") from None
    return getattr(hf, "text_config", None) or hf


def load_model_config(checkpoint: Path, cache_dir: Path | None = None) -> ModelConfig:
    """``ModelConfig`` of ``checkpoint``, from the cache when this config.json was seen before with
    this transformers version (``<cache>/model_configs/``); else derived and cached. A cache that
    cannot be written or read back is skipped, never an error."""
    config_file = checkpoint / "config.json"
    try:
        raw = config_file.read_bytes()
    except OSError:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no config.json") from None
    entry = _cache_entry(raw, cache_dir)
    try:
        return ModelConfig.from_json(json.loads(entry.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    config = ModelConfig.from_hf_config(load_hf_config(checkpoint))
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(config.to_json(), out)
        os.replace(tmp, entry)
    except OSError as exc:
        log.debug("model config not cached (%s)", exc)
    return config


def _cache_entry(config_json: bytes, cache_dir: Path | None) -> Path:
    if cache_dir is None:
        from common.engine.loading.default_model import default_cache_dir

        cache_dir = default_cache_dir()
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = "none"
    key = hashlib.sha256(b"%d\0%s\0" % (CONFIG_CACHE_VERSION, transformers_version.encode()) + config_json)
    return Path(cache_dir) / "model_configs" / f"{key.hexdigest()[:32]}.json"
