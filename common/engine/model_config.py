"""The model facts the engine needs, derived once from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    hf_config: Any  # the transformers config, for rotary-embedding parameters

    def window(self, layer: int) -> int | None:
        """Tokens a query at position p may see in this layer (p itself included), or None for all."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_config(cls, hf: Any) -> "ModelConfig":
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
            hf_config=hf,
        )
