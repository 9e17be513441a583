"""Each row's maximum and first maximal index, as ``torch.max(x, dim=-1)``, for fp32 CPU logits:
``csrc/row_argmax_cpu.c`` (16 lanes a row, rows across threads), ~6x faster than torch's kernel
on a 262k vocabulary (1 row 0.22 -> 0.04 ms, 16 rows 1.79 -> 0.26 ms on 2 cores) -- the greedy token of
every decode step.  Elsewhere, torch's ``max``."""
from __future__ import annotations

import ctypes
import functools

import torch

from common.engine.cpu_kernels import kernel_function, profiled

PROFILER_LABEL = "row_argmax"
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _kernel():
    return kernel_function("row_argmax_cpu", "row_argmax", [_PTR, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_int])


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of ``x.max(dim=-1)`` for a 2-D ``x`` (NaN, where a row has one, is its
    maximum, at its first NaN; ties go to the first index)."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1
            or not 0 < x.shape[1] < 2**31  # the kernel keeps indices in 32-bit lanes
            or torch.compiler.is_compiling() or _kernel() is None):
        return x.max(dim=-1)
    rows = x.shape[0]
    values, indices = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int64)
    if rows:
        with profiled(PROFILER_LABEL):
            _kernel()(x.data_ptr(), rows, x.shape[1], x.stride(0), values.data_ptr(), indices.data_ptr(),
                      torch.get_num_threads())
    return values, indices
