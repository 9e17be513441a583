"""int8 weights times fp32 (or bf16) activation rows with fp32 sums (``csrc/int8_gemv_cpu.c``): the
int8 products for decode batches where ``int8_vnni`` has no build (neither AVX512-VNNI nor AVX2 with
FMA: the scalar loop) or is turned off (``Int8Weight(vnni=False)``).

The weight is packed in blocks of 8 output channels, k-major (``[ceil(out / 8), in, 8]`` int8, the
layout ``Int8Weight`` stores); each entry reads activation rows of ``in`` values.
"""
from __future__ import annotations

import ctypes
import functools

import torch

# Rows the C kernel takes: as fast as the fp32 product from 32 rows up on the AVX2 machine (both
# compute-bound there), far faster below; past this, a prefill chunk dequantizes the weight once.
GEMV_MAX_ROWS = 128

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def kernel():
    """The fp32-row entry (``int8_gemv_f32``), or None (no compiler: the fp32 product)."""
    from common.engine.cpu_kernels import kernel_function

    return kernel_function("int8_gemv_cpu", "int8_gemv_f32", [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64])


def bf16_kernel():
    """The bf16-row entry (CPUs with AVX512-BF16), or None."""
    from common.engine.cpu_kernels import kernel_function

    return kernel_function("int8_gemv_cpu", "int8_gemv_bf16", [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64],
                           cpu_specific=True)


@functools.cache  # looked up once: a greedy step on an int8 head calls it
def argmax_kernel():
    """The greedy entry (``int8_gemv_argmax``, CPUs with AVX2: each row's first maximal output), or None."""
    from common.engine.cpu_kernels import kernel_function

    return kernel_function("int8_gemv_cpu", "int8_gemv_argmax", [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR],
                           restype=ctypes.c_int, cpu_specific=True)


def argmax(entry, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
           in_features: int) -> torch.Tensor | None:
    """Each fp32 row's first maximal index of the ``int8_gemv_f32`` product (int64 ``[rows]``) by the
    greedy entry, or None where some product was not finite (the caller computes the products)."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"int8 argmax: expected rows of {in_features} inputs, got {tuple(x.shape)}")
    a = x.detach().contiguous()
    tokens = torch.empty(a.shape[0], dtype=torch.int64)
    status = entry(a.data_ptr(), a.shape[0], packed.data_ptr(), scale.data_ptr(), out_features, in_features,
                   tokens.data_ptr()) if a.shape[0] else 0
    if status < 0:
        raise MemoryError("int8 argmax: scratch allocation failed")
    return tokens if status == 0 else None
