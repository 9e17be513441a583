"""Read a GGUF checkpoint into a Hugging Face config dict and an fp32 state dict.

llama.cpp's ``convert_hf_to_gguf.py`` changes a checkpoint in three ways that we undo here:

- **Names.** ``model.layers.N.self_attn.q_proj.weight`` becomes ``blk.N.attn_q.weight``, etc.
- **Shapes.** GGUF lists dimensions fastest-first (``ne[0]`` is the row length), the reverse of torch.
  The reader's arrays are already row-major, so we only reshape to ``reversed(tensor.shape)``.
- **Values.**
  - Llama-arch (Llama, Mistral) Q and K rows are permuted from HF's "rotate half" RoPE layout into
    GGML's interleaved layout. Per head of ``head_dim`` rows::

        HF   rows: [r0 r1 ... r(d/2-1) | i0 i1 ... i(d/2-1)]      (real halves, then imaginary)
        GGUF rows: [r0 i0 r1 i1 ... r(d/2-1) i(d/2-1)]            (pairs interleaved)

    Qwen2/Qwen3 are converted without the permutation.
  - Gemma 3 stores every ``*norm.weight`` plus one, because Gemma's RMSNorm computes ``x * (1 + w)``
    and GGML multiplies by ``w``. We subtract the one again.

Everything else (rope scaling, sliding windows, token ids) comes from the metadata keys.
"""

from __future__ import annotations

import math
import os
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from common.engine.loading.gguf_blocks import FOUR_BIT_TYPES, blocks_state, four_bit_groups
from common.engine.loading.gguf_file import GGUFFile


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# Gemma 3: one full-attention layer after every five sliding ones; sliding layers use this RoPE base.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; its "ffn_norm" is the norm *before* the MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors llama.cpp derives from the config; they feed the config, not the state dict.
_DERIVED_TENSORS = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and sanity-check a GGUF file.

    Raises FileNotFoundError if ``path`` does not exist and ValueError (naming the path) if it is not a
    readable GGUF file, is truncated, or holds an unsupported architecture.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, struct.error) as e:  # bad bytes, a short file, an unknown type
        raise ValueError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})"
        ) from e
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return reader


def hf_config_from_gguf(reader: GGUFFile) -> dict:
    """Build a transformers 5.x config dict (``AutoConfig.for_model(**d)`` accepts it) from GGUF metadata.

    Raises ValueError naming the file for missing keys or features we cannot express.
    """
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    n_heads = _require(reader, f"{arch}.attention.head_count")
    hidden = _require(reader, f"{arch}.embedding_length")
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_heads)
    if not isinstance(n_heads, int) or not isinstance(n_kv, int):
        raise ValueError(f"{reader.path}: per-layer head counts are not supported")
    head_dim = key("attention.key_length", hidden // n_heads)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{reader.path}: missing tensor 'token_embd.weight'")
    cfg = {
        "model_type": arch,
        "architectures": None,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": _require(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _require(reader, f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": _require(reader, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    rope_dims = key("rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(
            f"{reader.path}: partial rotary embeddings (rope.dimension_count={rope_dims}, "
            f"head_dim={head_dim}) are not supported"
        )
    rope = _rope_parameters(reader, arch, _f32(key("rope.freq_base", 10_000.0)), tensors, head_dim)
    if arch == "gemma3":
        _gemma3_fields(reader, cfg, rope)
    else:
        _llama_family_fields(reader, cfg, rope, tensors)
    cfg["architectures"] = [_ARCH_CLASS[cfg["model_type"]]]
    return cfg


_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def _llama_family_fields(reader, cfg: dict, rope: dict, tensors: dict) -> None:
    arch = cfg["model_type"]
    cfg["rope_parameters"] = rope
    cfg["hidden_act"] = "silu"
    if arch == "llama":
        window = _field(reader, "llama.attention.sliding_window")
        if "mistral" in str(_field(reader, "general.name", "")).lower():
            cfg["model_type"] = "mistral"  # llama.cpp files Mistral under the llama architecture
            cfg["sliding_window"] = window
            return
        if window is not None:
            raise ValueError(f"{reader.path}: sliding-window attention on llama arch is not supported")
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    else:  # qwen2 always has q/k/v biases; qwen3 may
        if arch == "qwen3":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["use_sliding_window"] = False


def _gemma3_fields(reader, cfg: dict, full_rope: dict) -> None:
    arch = "gemma3"
    n_layers = cfg["num_hidden_layers"]
    cfg["model_type"] = "gemma3_text"
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["sliding_window"] = _field(reader, f"{arch}.attention.sliding_window")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # per-layer flags, True = sliding
        is_sliding = [bool(x) for x in pattern]
    else:
        is_sliding = [(i + 1) % pattern != 0 for i in range(n_layers)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in is_sliding]
    local_theta = _f32(_field(reader, f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
    cfg["rope_parameters"] = {
        "full_attention": full_rope,
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    }
    # llama.cpp hard-codes the attention scale: 1/sqrt(head_dim), except Gemma 3 27B (62 layers),
    # which uses 1/sqrt(hidden_size / num_heads). A file may also carry it explicitly.
    scale = _field(reader, f"{arch}.attention.scale")
    if scale:
        cfg["query_pre_attn_scalar"] = _f32(1.0 / scale**2)
    elif n_layers == 62:
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    softcap = _field(reader, f"{arch}.final_logit_softcapping")
    cfg["final_logit_softcapping"] = _f32(softcap) if softcap else None
    cfg["attn_logit_softcapping"] = None


def _rope_parameters(reader, arch: str, theta: float, tensors: dict, head_dim: int) -> dict:
    """RoPE settings in transformers 5.x ``rope_parameters`` form."""
    path = reader.path
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if "rope_freqs.weight" in tensors:
        if scaling not in ("none", "linear") or (scaling == "linear" and factor not in (None, 1.0)):
            raise ValueError(f"{path}: rope_freqs combined with rope scaling {scaling!r} is not supported")
        freq_factors = _dequantize(tensors["rope_freqs.weight"], path).reshape(-1).astype(np.float64)
        return _llama3_rope_from_factors(freq_factors, theta, head_dim, path)
    if scaling == "none" or (scaling == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": _f32(factor)}
    if scaling == "yarn":
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is None:
            raise ValueError(f"{path}: yarn rope scaling without rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": _f32(factor),
            "original_max_position_embeddings": orig,
        }
    raise ValueError(f"{path}: unsupported rope scaling type {scaling!r}")


def _llama3_rope_from_factors(ff: np.ndarray, theta: float, head_dim: int, path) -> dict:
    """Recover Llama 3.x ``rope_scaling`` from llama.cpp's per-frequency divisor tensor ``rope_freqs``.

    convert_hf_to_gguf writes, per frequency: 1 for short wavelengths, ``factor`` for long ones and a
    smooth blend in between, where ``1/ff = (1 - s)/factor + s`` and
    ``s = (orig_ctx / wavelen - low) / (high - low)`` is linear in ``1/wavelen``. Fitting that line
    gives ``orig_ctx/(high-low)`` and ``low/(high-low)``; with Meta's ``low_freq_factor = 1`` (every
    released Llama 3.x) the rest follows. The result is checked by recomputing ``ff``.
    """
    if np.allclose(ff, 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(ff.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (ff > 1.0 + 1e-6) & (ff < factor - 1e-6)
    if mid.sum() < 2 or len(ff) != len(wavelen):
        raise ValueError(f"{path}: cannot infer llama3 rope scaling from rope_freqs.weight")
    s = (1.0 / ff[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[mid], s, 1)
    low = 1.0
    high = low - 1.0 / intercept
    orig = slope * (high - low)
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": _f32(factor),
        "low_freq_factor": low,
        "high_freq_factor": round(high, 4),
        "original_max_position_embeddings": int(round(orig)),
    }
    # Re-derive ff with the fitted parameters; a mismatch means our assumption (low = 1) was wrong.
    orig_ctx, high = params["original_max_position_embeddings"], params["high_freq_factor"]
    smooth = np.clip((orig_ctx / wavelen - low) / (high - low), 0, 1)
    rebuilt = 1.0 / ((1 - smooth) / factor + smooth)
    if not np.allclose(rebuilt, ff, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight does not match any llama3 rope scaling we can express")
    return params


def state_dict_from_gguf(reader: GGUFFile, config: dict,
                         progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 and return it under its Hugging Face name, conversions undone."""
    path = reader.path
    arch = _field(reader, "general.architecture")
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    state = {}
    tensors = tqdm(reader.tensors, desc=f"dequantize {Path(path).name}", unit="tensor", disable=not progress)
    for t, hf_name in _checkpoint_tensors(reader, tensors):
        w = _rows_in_checkpoint_order(_dequantize(t, path), t.name, arch, n_heads, n_kv)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors are views of the read-only memory map
            w = w.copy()
        state[hf_name] = torch.from_numpy(w)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in state]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    return state


def source_blocks_from_gguf(reader: GGUFFile, config: dict) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Each weight's GGUF type by its Hugging Face name, and the 4-bit weights' groups
    (``common.engine.loading.gguf_blocks``: what ``--quantization int4`` keeps as the file has it)."""
    arch = _field(reader, "general.architecture")
    types, blocks = {}, {}
    for t, hf_name in _checkpoint_tensors(reader, reader.tensors):
        types[hf_name] = t.tensor_type.name
        shape = tuple(reversed(t.shape))
        if t.tensor_type.name in FOUR_BIT_TYPES and len(shape) == 2:
            groups = four_bit_groups(t.data, t.tensor_type, shape)
            groups = [_rows_in_checkpoint_order(a, t.name, arch, config["num_attention_heads"],
                                                config["num_key_value_heads"]) for a in groups]
            blocks.update(blocks_state(hf_name, *groups))
    return types, blocks


def load_gguf(path: str | os.PathLike, progress: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``path`` and return ``(hf_config_dict, fp32_state_dict)`` in Hugging Face naming."""
    reader = open_gguf(path)
    config = hf_config_from_gguf(reader)
    return config, state_dict_from_gguf(reader, config, progress=progress)


def load_gguf_tokenizer(path: str | os.PathLike, model_type: str | None = None):
    """Build a transformers tokenizer from the vocabulary embedded in a GGUF file.

    With ``model_type`` (the converted config's) the tokenizer class for it is asked directly:
    ``AutoTokenizer`` would first read the whole file again through gguf-py's reader just to learn
    that class (~20 s for a 262k vocabulary). Without it, or for a type transformers maps to no
    class by name, ``AutoTokenizer`` decides.
    """
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type) if model_type else None
    tokenizer_class = tokenizer_class_from_name(class_name) if isinstance(class_name, str) else None
    return (tokenizer_class or AutoTokenizer).from_pretrained(str(path.parent), gguf_file=path.name)


def _checkpoint_tensors(reader: GGUFFile, tensors):
    """``(tensor, its Hugging Face name)`` for each of ``tensors`` (the reader's, perhaps wrapped in
    a progress bar) that is a checkpoint weight (not one llama.cpp derives from the config)."""
    names = _GEMMA3_LAYER_NAMES if _field(reader, "general.architecture") == "gemma3" else _LAYER_NAMES
    for t in tensors:
        if t.name not in _DERIVED_TENSORS:
            yield t, _hf_name(t.name, names, reader.path)


def _hf_name(name: str, layer_names: dict, path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"{path}: unexpected tensor {name!r}")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{layer_names[part]}.{kind}"


def _dequantize(t, path) -> np.ndarray:
    """fp32 array in torch dimension order (GGUF's ``ne`` reversed)."""
    shape = tuple(reversed(t.shape))
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name!r} has unsupported quant type {t.tensor_type.name}") from e
    return np.asarray(w, dtype=np.float32).reshape(shape)


def _rows_in_checkpoint_order(w: np.ndarray, gguf_name: str, arch: str, n_heads: int, n_kv: int) -> np.ndarray:
    """``w``'s rows (any array whose rows are a weight's output channels) in the original order:
    llama's Q and K rows were permuted by the conversion."""
    if arch == "llama" and ".attn_q." in gguf_name:
        return _unpermute_rope(w, n_heads)
    if arch == "llama" and ".attn_k." in gguf_name:
        return _unpermute_rope(w, n_kv)
    return w


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's Q/K permutation (interleaved pairs back to rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFFile, name: str, default=None):
    return reader.field(name, default)


def _require(reader: GGUFFile, name: str):
    value = _field(reader, name)
    if value is None:
        raise ValueError(f"{reader.path}: missing metadata key {name!r}")
    return value


def _f32(x: float) -> float:
    """The shortest decimal that round-trips a float32 (GGUF stores 1e-6 as 9.99999997e-07)."""
    return float(str(np.float32(x)))
