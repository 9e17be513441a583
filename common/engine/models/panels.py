"""fp32 products of few rows (decode steps) on weights packed in panels: ``csrc/panel_gemm_cpu.c``.

A decode step multiplies a handful of rows by every weight of the model, and is bound by reading
the weights.  oneDNN's packed products (``common.engine.models.linear``) serve prefill chunks
best, but for few rows the C kernel, on its own copy of each weight laid out as panels of 16
output columns ([K][16] contiguous: one 64-byte load is one k of 16 outputs), reads the weights
faster.  Measured on a 2-vCPU Sapphire Rapids VM (Gemma 3 270M fp32, whole decode steps):
batch 1 63.7 -> 54 ms, batch 8 88.6 -> 69 ms, batch 16 113 -> 88 ms; the products alone, oneDNN
-> panels: the 262k x 640 LM head at 8 rows 32 -> 25 ms, 16 rows 41 -> 33, 32 rows 59-67 -> 49-59,
64 rows at parity; the layers' products 1.1-1.5x faster up to 48 rows (hence ``PANEL_MAX_ROWS``).
On a 2-vCPU AMD EPYC with AVX2 only (the kernel's tiles sized for its 16 registers), the 18
layers' products then the LM head: 8 rows 43 -> 23 and 53 -> 36 ms, 16 rows 53 -> 35 and 72 -> 54,
32 rows ~1.2x.

The panels are a second copy of each fp32 weight (Gemma 3 270M: +1.07 GB); where the kernel
cannot be built (no C compiler) or the CPU has neither AVX-512 nor AVX2 with FMA (no tiles sized
for its registers), ``pack_panels`` returns ``None`` and oneDNN does every product.

**bf16 models** on CPUs with AVX512-BF16 get panels too, of input pairs (``csrc/bf16_panel_cpu.c``:
two bf16 products a lane an instruction, fp32 sums, the output rounded to bf16 as torch's bf16
linear rounds it).  oneDNN's bf16 products of few rows stream the weights at about half the
memory's rate; on a 2-vCPU Zen 4 (Gemma 3 270M bf16, 2 threads) the 262k x 640 LM head alone at
1 row 13.6 -> 9.4 ms, at 8 rows 14.9 -> 12.1 ms, and a whole decode step (interleaved in one
engine) 1 row 31.1 -> 22.2 ms, 8 rows 36.2 -> 25.4 ms.  They cost their weights' bytes again (Gemma
3 270M: +0.54 GB).  Elsewhere bf16 products stay oneDNN's.  On CPUs with AMX oneDNN's bf16 products
run on its tiles and catch up at 8 rows: there the bf16 panels take up to
``BF16_PANEL_MAX_ROWS_AMX`` rows (a 2-vCPU Sapphire Rapids-class VM, panels against oneDNN's packed
products alone: 4 rows 1.21-1.42x, 8 rows 0.94-1.03x, 12 rows 0.75-0.84x, 16 rows 0.56-0.65x; the
8-row decode-bound workload, interleaved in one engine, 164-173 tok/s with oneDNN at 8 rows, 172-180
on panels).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from common.engine import cpu_features
from common.engine.cpu_kernels import kernel_function, profiled

PANEL_MAX_ROWS = 32  # products with more rows go to oneDNN (see the module docstring)
BF16_PANEL_MAX_ROWS_AMX = 8  # bf16 ones on CPUs with AMX tiles (see the module docstring)
LANES = 16  # output columns per panel (the kernel's)
PROFILER_LABEL = "panel_gemm"

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _pack_fn():
    return kernel_function("panel_gemm_cpu", "pack_panels", [_PTR, _I64, _I64, _I64, _PTR, _INT])


@functools.cache  # looked up once: it is called for every product of a decode step
def _gemm_fn():
    return kernel_function("panel_gemm_cpu", "panel_gemm", [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT])


def _pack_bf16_fn():
    return kernel_function("bf16_panel_cpu", "pack_bf16_panels", [_PTR, _I64, _I64, _I64, _PTR, _INT],
                           cpu_specific=True)  # the source is empty without AVX512-BF16


@functools.cache  # looked up once: it is called for every product of a bf16 decode step
def _bf16_gemm_fn():
    return kernel_function("bf16_panel_cpu", "bf16_panel_gemm",
                           [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT], cpu_specific=True)


class PanelWeight:
    """A weight [out_features, in_features] packed in panels for ``panel_linear``: fp32 panels of
    single inputs, or bf16 panels of input pairs (``dtype``: the weight's, and the rows' it takes)."""

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int):
        self.panels = panels
        self.out_features = out_features
        self.in_features = in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def native() -> bool:
    """Whether the kernel has tiles sized for this CPU's registers (AVX-512, AVX2 + FMA; see the module)."""
    fn = kernel_function("panel_gemm_cpu", "panel_gemm_native", [], _INT)
    return fn is not None and fn() == 1


def pack_panels(weight: torch.Tensor) -> PanelWeight | None:
    """``weight`` (2-D, fp32 or bf16, CPU) in panels, or ``None`` where the kernel does not apply."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.numel() == 0:
        return None
    if weight.dtype == torch.float32:
        pack, pairs = (_pack_fn() if native() else None), 1
    elif weight.dtype == torch.bfloat16:
        pack, pairs = _pack_bf16_fn(), 2
    else:
        return None
    if pack is None:
        return None
    source = weight.detach()
    if source.stride(1) != 1:
        source = source.contiguous()
    out_features, in_features = source.shape
    panels = torch.empty(-(-out_features // LANES) * -(-in_features // pairs) * pairs * LANES, dtype=weight.dtype)
    pack(source.data_ptr(), source.stride(0), out_features, in_features, panels.data_ptr(), torch.get_num_threads())
    return PanelWeight(panels, out_features, in_features)


def gemm_entry():
    """The fp32 kernel's ``panel_gemm`` entry (``panel_linear``'s; ``common.engine.models.fused_layers``
    calls it)."""
    return _gemm_fn()


def max_rows(dtype: torch.dtype) -> int:
    """The most rows a product on panels of ``dtype`` takes (more go to oneDNN)."""
    return BF16_PANEL_MAX_ROWS_AMX if dtype == torch.bfloat16 and cpu_features.has_amx() else PANEL_MAX_ROWS


def applies(x: torch.Tensor, weight: PanelWeight | None) -> bool:
    """Whether ``panel_linear`` should compute ``x`` (2-D) by ``weight``: few rows of the weight's
    dtype (``max_rows``), eagerly."""
    return (weight is not None and x.shape[0] <= max_rows(weight.dtype) and x.dtype == weight.dtype
            and not torch.compiler.is_compiling())


def panel_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a 2-D ``x`` of the weight's dtype with ``W`` packed by ``pack_panels``
    (a bf16 result from bf16 panels: the fp32 sums plus the bias, rounded once)."""
    rows, in_features = x.shape
    if in_features != weight.in_features or x.dtype != weight.dtype:
        raise ValueError(f"panel product: input has {in_features} features of {x.dtype}, the weight "
                         f"{weight.in_features} of {weight.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, weight.out_features), dtype=weight.dtype)
    if not rows:
        return out
    if weight.dtype == torch.bfloat16:
        bias_values = bias.to(torch.bfloat16).contiguous() if bias is not None else None
        with profiled(PROFILER_LABEL):
            _bf16_gemm_fn()(x.data_ptr(), x.stride(0), weight.panels.data_ptr(),
                            bias_values.data_ptr() if bias_values is not None else None, rows, weight.out_features,
                            in_features, out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out
    with profiled(PROFILER_LABEL):
        _gemm_fn()(x.data_ptr(), x.stride(0), weight.panels.data_ptr(), rows, weight.out_features, in_features,
                   out.data_ptr(), out.stride(0), torch.get_num_threads())
    if bias is not None:
        out += bias
    return out
