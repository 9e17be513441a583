"""RMSNorm with the residual add or the rotary embedding after it, one kernel call for eager fp32 steps.

A decode step runs a few hundred of these small elementwise sequences (Gemma 3: six norms a layer,
two of them followed by RoPE, two by the residual add), each several torch ops of a few microseconds'
dispatch for a few hundred floats of work; ``csrc/norm_rope_cpu.c`` does each in one call.  It
applies to fp32 CPU tensors outside torch.compile (inductor fuses these loops itself); elsewhere the
callers keep their torch code, which the kernel matches to the last bit or two (the sum of squares
is ordered differently).  A bf16 model's norms (``norm_widened``) take the kernel too, on their rows
widened to fp32 and rounded back once, as the torch code computes them: 4 ops instead of 9 a norm
(a bf16 decode step of Gemma 3 270M on a Zen 4, interleaved in one engine: 1 row 25.1 -> 24.7 ms,
8 rows 30.8 -> 29.8 ms).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from common.engine.cpu_kernels import kernel_function, profiled

PROFILER_LABEL = "norm_rope"

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache  # resolved once: a decode step calls it a few hundred times
def kernel():
    """The C entry ``rms_norm_rope`` (``norm_rope``'s; ``fused_layers`` calls it too), or None."""
    return kernel_function("norm_rope_cpu", "rms_norm_rope",
                           [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR, _I64, _PTR, _PTR, _I64,
                            _PTR, ctypes.c_int], ctypes.c_int)


def applies(x: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether the kernel computes ``x``'s rows with ``operands`` (weight, residual, cos): all fp32,
    ``x`` on the CPU, 2-D or 3-D with contiguous rows, eagerly, and the kernel built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() in (2, 3) and x.stride(-1) == 1
            and all(t.dtype == torch.float32 for t in operands)
            and not torch.compiler.is_compiling() and kernel() is not None)


def widened_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``norm_widened`` computes ``x``'s rows: bf16 (or fp16) on the CPU, 2-D or 3-D,
    eagerly, and the kernel built."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and x.dim() in (2, 3)
            and weight.dim() == 1 and not torch.compiler.is_compiling() and kernel() is not None)


def norm_widened(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` of a narrow float ``x`` (``widened_applies``): its rows and ``weight`` widened to
    fp32, normed by the kernel, the result rounded once to ``x``'s dtype -- the values of the torch
    code (``x.float()`` normed, times ``weight.float()``, ``.to(dtype)``) but for the last bit or two
    of the fp32 result before the rounding."""
    return norm_rope(x.float(), weight.float(), eps).to(x.dtype)


def _checked_rows(t: torch.Tensor | None, tokens: int, dim: int, name: str) -> int:
    """Row stride of a per-token operand ([tokens, dim], contiguous rows), 0 for ``None``."""
    if t is None:
        return 0
    if t.dtype != torch.float32 or t.shape != (tokens, dim) or t.stride(-1) != 1:
        raise ValueError(f"norm_rope: {name} must be fp32 [{tokens}, {dim}] with contiguous rows, "
                         f"got {t.dtype} {tuple(t.shape)}")
    return t.stride(0)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0, residual: torch.Tensor | None = None,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ([tokens, dim] or [tokens, heads, dim], ``applies``) normed by ``weight`` (``None``: not
    normed), then added to ``residual`` ([tokens, dim]) or rotated by ``cos``/``sin`` ([tokens, dim])
    -- a new contiguous tensor of ``x``'s shape.  See the module and ``csrc/norm_rope_cpu.c``."""
    if x.dtype != torch.float32 or x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"norm_rope: x must be fp32 [tokens, (heads,) dim] with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    tokens, dim = x.shape[0], x.shape[-1]
    inner, s_inner = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    if weight is not None and (weight.dtype != torch.float32 or weight.shape != (dim,) or not weight.is_contiguous()):
        raise ValueError(f"norm_rope: weight must be fp32 [{dim}], got {weight.dtype} {tuple(weight.shape)}")
    if residual is not None and x.dim() != 2:
        raise ValueError("norm_rope: a residual is added to 2-D rows only")
    if (cos is None) != (sin is None) or (cos is not None and cos.stride() != sin.stride()):
        raise ValueError("norm_rope: cos and sin come together, laid out alike")
    s_res = _checked_rows(residual, tokens, dim, "residual")
    s_cs = _checked_rows(cos, tokens, dim, "cos")
    _checked_rows(sin, tokens, dim, "sin")
    out = torch.empty(x.shape, dtype=torch.float32)
    if out.numel():
        pointer = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        with profiled(PROFILER_LABEL):
            rc = kernel()(x.data_ptr(), tokens * inner, inner, x.stride(0), s_inner, dim, pointer(weight), eps,
                           pointer(residual), s_res, pointer(cos), pointer(sin), s_cs, out.data_ptr(),
                           torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"norm_rope: rows of {dim} values are not supported")
    return out
