"""int8 weights times int8-quantized activations on AVX512-VNNI CPUs, or AVX2 ones with FMA
(``csrc/int8_vnni_cpu.c``: two builds of one layout, the same integer sums and outputs).

The weight is held in the kernel's layout only -- blocks of 16 output channels by quads of 4 inputs,
``w[n // 16, k // 4, n % 16, k % 4] = q[n, k] + 128`` (uint8), channels padded to a multiple of 16
and inputs to a multiple of 4 with zero weights -- and the activations are quantized per row in
groups of ``ACTIVATION_GROUP`` inputs, symmetric (``xq = round(x * 127 / amax)``, scale
``amax / 127``), inside the kernel.  ``reference_product`` is the same arithmetic in torch (tests).
"""
from __future__ import annotations

import ctypes
import functools

import torch

# Inputs per activation scale.  Per row (one scale) costs Gemma 3 270M +5.4% perplexity -- its hidden
# states have single channels hundreds of times the rest; groups of 64 or 128 inputs keep it within
# half a percent of fp32 (benchmarks/quant_quality.py, the whole text, one machine: 64 -0.43% with
# greedy agreement 0.41, 128 -0.02% with 0.52; int4, whose int8 weights take the same groups,
# -0.10% / 0.48 and -0.21% / 0.45).  Each group's integer sums are converted and scaled once, so
# 128 scales half as often: on AMX tiles, where that scaling is most of a product's work, the
# layers' products 1.3-1.4x faster at 64 and 512 rows, 1.1-1.2x at 8; quantized.py --quick's int8
# workloads (two processes each, alternating) batch 64 307-323 -> 350-356 tok/s, decode-bound
# 388-394 -> 402-408.  256 (a further 1.2x on those products) costs int8 +0.54% and int4 +0.58%,
# with greedy agreement 0.45 and 0.34: not taken.
ACTIVATION_GROUP = 128
LANES, QUAD = 16, 4


def kernel():
    """The kernel's entry, or None (no compiler, or a CPU with neither AVX512-VNNI nor AVX2 and FMA)."""
    from common.engine.cpu_kernels import kernel_function

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("int8_vnni_cpu", "int8_vnni_gemm", [ptr, i64, i64, ptr, ptr, ptr, i64, i64],
                           restype=ctypes.c_int, cpu_specific=True)  # the source is empty without either


def product_path(allow_amx: bool = True) -> str:
    """Which tiles the kernel's products of 5 or more rows run on from now on in this process:
    ``"amx"`` (AMX-INT8, where the CPU has it and Linux grants it; ``csrc/int8_amx.h``), ``"vnni"``,
    ``"avx2"`` (the AVX2 build: every row count) or ``"none"`` (no build); ``allow_amx=False`` keeps
    AMX out (tests compare the two)."""
    from common.engine.cpu_kernels import kernel_function

    fn = kernel_function("int8_vnni_cpu", "int8_vnni_path", [ctypes.c_int], ctypes.c_int, cpu_specific=True)
    return ("none", "vnni", "amx", "avx2")[fn(int(allow_amx)) if fn is not None else 0]


@functools.cache  # looked up once: a greedy step on an int8 head calls it
def argmax_kernel():
    """The kernel's greedy entry (``int8_vnni_argmax``: each row's first maximal output), or None."""
    from common.engine.cpu_kernels import kernel_function

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("int8_vnni_cpu", "int8_vnni_argmax", [ptr, i64, i64, ptr, ptr, i64, i64, ptr],
                           restype=ctypes.c_int, cpu_specific=True)


@functools.cache  # looked up once: every step's embedding lookup on a tied int8 head calls it
def rows_kernel():
    """The kernel's lookup entry (``int8_vnni_rows``: rows of the weight times their scales), or None."""
    from common.engine.cpu_kernels import kernel_function

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("int8_vnni_cpu", "int8_vnni_rows", [ptr, ptr, i64, i64, ptr, i64, ptr],
                           restype=ctypes.c_int, cpu_specific=True)


def scaled_rows(packed: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, out_features: int,
                in_features: int) -> torch.Tensor | None:
    """``q[ids] * scale[ids]`` (fp32 ``[*ids.shape, in_features]``) by the kernel, the values torch's
    ``unpack_rows(...).float() * scale[ids, None]`` gives, in one call instead of ten small ops a
    decode step; None where the kernel is not built."""
    entry = rows_kernel()
    if entry is None:
        return None
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, in_features, dtype=torch.float32)
    if entry(packed.data_ptr(), scale.data_ptr(), out_features, in_features, flat.data_ptr(), flat.numel(),
             out.data_ptr()) != 0:
        raise IndexError(f"embedding lookup: a token id outside [0, {out_features})")
    return out


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q`` ``[out, in]`` in the kernel's layout (``[ceil(out / 16), ceil(in / 4), 16, 4]`` uint8)."""
    out_features, in_features = q.shape
    n_pad, k_pad = -(-out_features // LANES) * LANES, -(-in_features // QUAD) * QUAD
    padded = torch.nn.functional.pad(q, (0, k_pad - in_features, 0, n_pad - out_features))
    offset = padded.view(torch.uint8) ^ 0x80  # q + 128 as a byte: its sign bit flipped
    return offset.reshape(n_pad // LANES, LANES, k_pad // QUAD, QUAD).permute(0, 2, 1, 3).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """``q[ids]`` (int8 ``[*ids.shape, in_features]``) from the kernel's layout."""
    rows = packed[ids // LANES, :, ids % LANES, :]  # [*ids.shape, in / 4, 4]
    return (rows.reshape(*ids.shape, -1)[..., :in_features] ^ 0x80).view(torch.int8)


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int8 ``q`` ``[out, in]`` back from the kernel's layout."""
    q = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * LANES, -1)[:out_features, :in_features]
    return (q ^ 0x80).view(torch.int8)


def product(entry, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
            in_features: int) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[rows, out]``) by the kernel; ``x`` any float dtype, ``[rows, in_features]``."""
    return run_entry("int8", entry, x, in_features, (packed, scale), out_features, ACTIVATION_GROUP)


def argmax(entry, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
           in_features: int) -> torch.Tensor | None:
    """Each row's first maximal index of ``product(x, ...)`` (int64 ``[rows]``) by the greedy entry,
    or None where some product was not finite (the caller computes the products)."""
    x = _fp32_rows("int8 argmax", x, in_features)
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    status = entry(x.data_ptr(), x.shape[0], in_features, packed.data_ptr(), scale.data_ptr(), out_features,
                   ACTIVATION_GROUP, tokens.data_ptr()) if x.shape[0] else 0
    if status < 0:
        raise MemoryError("int8 VNNI argmax: scratch allocation failed")
    return tokens if status == 0 else None


def run_entry(scheme: str, entry, x: torch.Tensor, in_features: int, weight: tuple[torch.Tensor, ...],
              out_features: int, group: int) -> torch.Tensor:
    """A VNNI kernel's product (the int8 and int4 entries alike: ``entry(x, rows, in, *weight, y, out,
    group)``) into a new fp32 ``[rows, out]``; rows of another width are refused (the kernels read the
    weight by the rows' width)."""
    x = _fp32_rows(f"{scheme} product", x, in_features)
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    status = entry(x.data_ptr(), x.shape[0], in_features, *[t.data_ptr() for t in weight], y.data_ptr(),
                   out_features, group)
    if status != 0:
        raise MemoryError(f"{scheme} VNNI product: scratch allocation failed") if status == -1 else \
            ValueError(f"{scheme} VNNI product: {in_features} inputs do not fit groups of {group}")
    return y


def _fp32_rows(what: str, x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x`` as the kernels read it (contiguous fp32 rows); rows of another width are refused (the
    kernels read the weight by the rows' width)."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{what}: expected rows of {in_features} inputs, got {tuple(x.shape)}")
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def quantize_activations(x: torch.Tensor, group: int = ACTIVATION_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: int32 ``xq`` ``[rows, in]`` and fp32 scales
    ``[rows, groups]`` (``xq * scale`` of each group approximates ``x``)."""
    rows, in_features = x.shape
    groups = -(-in_features // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - in_features)).reshape(rows, groups, group)
    amax = padded.abs().amax(-1)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(padded * inverse[..., None]).to(torch.int32)
    return xq.reshape(rows, -1)[:, :in_features], amax / 127.0


def reference_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      group: int = ACTIVATION_GROUP) -> torch.Tensor:
    """The kernel's arithmetic in torch (fp64 sums of exact integer group sums): tests."""
    xq, xs = quantize_activations(x, group)
    in_features = x.shape[1]
    total = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    for g in range(xs.shape[1]):
        cols = slice(g * group, min((g + 1) * group, in_features))
        sums = xq[:, cols].to(torch.int64) @ q[:, cols].to(torch.int64).t()  # exact
        total += sums.double() * xs[:, g : g + 1].double()
    return (total * scale.double()[None, :]).float()
