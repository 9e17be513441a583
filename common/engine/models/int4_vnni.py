"""4-bit weights times int8-quantized activations on AVX512-VNNI CPUs, or AVX2 ones with FMA
(``csrc/int4_vnni_cpu.c``: two builds of one layout, the same integer sums).

The weight ``w = (q - 8) * scale + zero`` (``q`` in 0..15, one scale and zero per output channel and
group of inputs) is held in the kernel's layout: blocks of 16 output channels by 8 inputs, byte ``j``
of channel ``c`` holding ``q[c, k + j]`` in its low nibble and ``q[c, k + 4 + j]`` in its high one;
and the scales and zeros per block and group, ``[out / 16, groups, 16]``.  The activations are
quantized per row in the weight's own groups, as ``int8_vnni`` does; the zero points multiply the
activations' exact group sums.
"""
from __future__ import annotations

import ctypes

import torch

from common.engine.models.int8_vnni import LANES, quantize_activations, run_entry


def kernel():
    """The kernel's entry, or None (no compiler, or a CPU with neither AVX512-VNNI nor AVX2 and FMA)."""
    from common.engine.cpu_kernels import kernel_function

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("int4_vnni_cpu", "int4_vnni_gemm", [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64],
                           restype=ctypes.c_int, cpu_specific=True)  # the source is empty without either


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
         group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` ``[out, in]`` (0..15) and fp32 ``scale``/``zero`` ``[out, in / group_size]`` in the kernel's
    layout: the nibbles ``[out / 16, in / 8, 16, 4]`` uint8, the scales and zeros ``[out / 16, groups,
    16]`` fp32."""
    out_features, in_features = q.shape
    eights = q.to(torch.uint8).reshape(out_features // LANES, LANES, in_features // 8, 2, 4)
    nibbles = (eights[:, :, :, 0, :] | (eights[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).contiguous()

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [out / 16, groups, 16]
        return t.float().reshape(out_features // LANES, LANES, -1).transpose(1, 2).contiguous()

    return nibbles, per_block(scale), per_block(zero)


def unpack(nibbles: torch.Tensor, scale: torch.Tensor,
           zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` (uint8 ``[out, in]``), ``scale`` and ``zero`` (fp32 ``[out, groups]``) back from ``pack``."""
    blocks, eights = nibbles.shape[:2]
    low, high = nibbles & 0x0F, nibbles >> 4
    q = torch.stack([low, high], dim=3).permute(0, 2, 1, 3, 4).reshape(blocks * LANES, eights * 8)
    per_channel = lambda t: t.transpose(1, 2).reshape(blocks * LANES, -1)  # noqa: E731
    return q, per_channel(scale), per_channel(zero)


def product(entry, x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            out_features: int, group_size: int) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[rows, out]``) by the kernel; ``x`` any float dtype, ``[rows, in]``."""
    return run_entry("int4", entry, x, nibbles.shape[1] * 8, (nibbles, scale, zero), out_features, group_size)


def reference_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      group_size: int) -> torch.Tensor:
    """The kernel's arithmetic in torch (exact integer group sums, fp64 scaling): tests."""
    xq, xs = quantize_activations(x, group_size)
    total = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    for g in range(xs.shape[1]):
        cols = slice(g * group_size, (g + 1) * group_size)
        sums = xq[:, cols].to(torch.int64) @ (q[:, cols].to(torch.int64) - 8).t()  # exact
        total += xs[:, g : g + 1].double() * sums.double() * scale[:, g].double()[None, :]
        total += x[:, cols].double().sum(1, keepdim=True) * zero[:, g].double()[None, :]
    return total.float()
