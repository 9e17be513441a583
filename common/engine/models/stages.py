"""The two halves of a decoder layer around attention, run eagerly or compiled by torch.compile.

Attention reads and writes the paged KV cache through kernels torch.compile cannot trace (the C
kernel, Triton, flash-attn), so a layer is split at it::

    attention_inputs(layer, x, cos, sin) -> q, k, v     input norm, fused q/k/v product, q/k norms, RoPE
    backend.forward(q, k, v, ...)        -> attended    eager, always
    after_attention(layer, x, attended)  -> x           output product, norms, residual adds, MLP

Compiled (inductor), each half becomes a few fused loops around the matrix products, which stay
library calls (oneDNN on packed weights through ``linear``'s custom op): RMSNorm's five passes,
RoPE's four and the gated activation's three each become one. That pays on prefill-sized steps
(on a 2-core AVX-512 machine, Gemma 3 270M, a 2048-token step on packed weights: fp32 -5%, bf16
-9%); on decode-sized steps the generated loops, parallel whatever their size, were no faster
than eager and sometimes slower, so steps under ``MIN_COMPILED_TOKENS`` tokens run eagerly.  (On the
CPU in fp32 on one rank, steps of up to ``fused_layers.MAX_ROWS`` tokens take the fused layers first,
where they apply: faster than either there.)

Bounded recompiles: one compiled function serves every layer (its guards are on the layer's
structure, not on which layer it is), and token counts are symbolic (``dynamic=True``), so each
half compiles one graph for every count from ``MIN_COMPILED_TOKENS`` up (two where plain fp32
weights change library at ``ONEDNN_MAX_ROWS``), per dtype. ``compile_stages`` compiles them up
front, on dummy inputs below and above that bound, so no request pays for it; where compiling
fails (no C++ compiler, an unsupported op) it says why and the engine runs eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Steps with fewer tokens run eagerly (see the module docstring).
MIN_COMPILED_TOKENS = 64
# Token counts compiled at start-up, below and above ``ONEDNN_MAX_ROWS`` (see the module
# docstring); odd, so that no model dimension equals them when the symbolic shapes are traced.
WARM_UP_TOKENS = (MIN_COMPILED_TOKENS + 3, 523)


def _attention_inputs(layer, x, cos, sin):
    return layer.attention_inputs(x, cos, sin)


def _after_attention(layer, x, attended):
    return layer.after_attention(x, attended)


@dataclass(frozen=True)
class LayerStages:
    """How a ``DecoderLayer`` runs its halves: ``attention_inputs(layer, x, cos, sin)`` and
    ``after_attention(layer, x, attended)``."""

    attention_inputs: Callable
    after_attention: Callable
    compiled: bool = False


EAGER = LayerStages(_attention_inputs, _after_attention)


def _by_size(compiled: Callable, eager: Callable) -> Callable:
    def run(layer, x, *args):
        return (compiled if x.shape[0] >= MIN_COMPILED_TOKENS else eager)(layer, x, *args)

    return run


def compile_stages(model) -> LayerStages:
    """Compiled stages for ``model`` (a loaded ``DecoderModel``), warmed up on every token bucket
    and every layer; ``EAGER`` (with a warning saying why) where compiling fails."""
    # Each dimension a symbol of its own: with duck sizing, a warm-up token count that happens to
    # equal a weight dimension would tie the two, and other counts would recompile mid-serving.
    torch.fx.experimental._config.use_duck_shape = False
    stages = LayerStages(
        _by_size(torch.compile(_attention_inputs, dynamic=True, fullgraph=True), _attention_inputs),
        _by_size(torch.compile(_after_attention, dynamic=True, fullgraph=True), _after_attention), compiled=True)
    began = time.perf_counter()
    try:
        warm_up(model, stages)
    except Exception as exc:  # inductor needs a C++ compiler and can meet ops it cannot lower
        log.warning("torch.compile of the decoder layers failed, running eagerly: %s: %s",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return EAGER
    log.info("compiled the decoder layers (inductor, token buckets %s) in %.1f s",
             ", ".join(map(str, WARM_UP_TOKENS)), time.perf_counter() - began)
    return stages


@torch.inference_mode()
def warm_up(model, stages: LayerStages) -> None:
    """Run both halves of every layer once per token bucket on zeros, as the forward would call them."""
    cfg = model.cfg
    param = next(model.parameters())
    for tokens in WARM_UP_TOKENS:
        positions = torch.zeros(tokens, dtype=torch.long, device=param.device)
        rope = {t: model.rotary.cos_sin(positions, t, param.dtype) for t in set(cfg.layer_types)}
        x = torch.zeros(tokens, cfg.hidden_size, dtype=param.dtype, device=param.device)
        attended = torch.zeros(tokens, cfg.num_heads, cfg.head_dim, dtype=param.dtype, device=param.device)
        for layer in model.model.layers:
            cos, sin = rope[layer.self_attn.layer_type]
            stages.attention_inputs(layer, x, cos, sin)
            stages.after_attention(layer, x, attended)
