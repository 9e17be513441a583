"""Rotary position embeddings, per layer type (Gemma 3 uses another base on sliding layers)."""
from __future__ import annotations

import torch

from common.engine.models import norm_rope

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


RopeTables = dict[str, tuple[tuple[float, ...], float]]  # layer type -> (inverse frequencies, scaling)


def rope_tables(hf_config, head_dim: int, layer_types: tuple[str, ...]) -> RopeTables:
    """Inverse frequencies and the attention scaling per layer type, exactly as transformers
    computes them (its own functions for the scaled types). Plain floats, so a ``ModelConfig``
    holding them can be cached as JSON and a worker need not import transformers to start."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    per_layer_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    tables: RopeTables = {}
    for layer_type in sorted(set(layer_types)):
        layer_params = params.get(layer_type, {}) if per_layer_type else params
        rope_type = layer_params.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_STATIC_ROPE_TYPES)}")
        if rope_type == "default":
            base = layer_params.get("rope_theta", 10000.0)
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kwargs = {"layer_type": layer_type} if per_layer_type else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
        tables[layer_type] = (tuple(inv_freq.float().tolist()), float(scaling))
    return tables


class RotaryEmbedding:
    """cos/sin tables for a step's positions, from ``rope_tables``' frequencies (fp32, as transformers)."""

    def __init__(self, tables: RopeTables, device: torch.device):
        # each frequency twice, (f, f): the angles of both halves of a head in one product
        self._inv_freq = {t: torch.tensor(freqs + freqs, dtype=torch.float32, device=device)
                          for t, (freqs, _) in tables.items()}
        self._scaling = {t: scaling for t, (_, scaling) in tables.items()}

    def cos_sin(self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position times each frequency, ``[tokens, head_dim]`` in ``dtype``,
        times the attention scaling where it is not 1 (a decode step makes these for every layer
        type: as few small ops as it takes)."""
        angles = torch.outer(positions.float(), self._inv_freq[layer_type])
        cos, sin = angles.cos(), angles.sin()
        scaling = self._scaling[layer_type]
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [tokens, heads, head_dim] by per-token ``cos``/``sin`` [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` in one kernel call where ``norm_rope`` applies (eager fp32), else as it is."""
    if norm_rope.applies(x, cos):
        return norm_rope.norm_rope(x, None, cos=cos, sin=sin)
    return apply_rotary(x, cos, sin)
