"""Quantized products (``--quantization``): the weights are stored in fewer bytes and
every product reads those, so a decode step -- bound by reading weights -- moves less memory.

    scheme  weight                                       product (CPU)                      (CUDA)
    int8    int8 per output channel, symmetric:          AVX512-VNNI or AVX2 with FMA:       --
            w = q * scale[row]                           csrc/int8_vnni_cpu.c (activations
                                                         quantized to int8 per row and group
                                                         of 128 inputs; exact int32 sums; 5+
                                                         rows on AMX tiles where the CPU has
                                                         them).  Elsewhere, few rows:
                                                         csrc/int8_gemv_cpu.c (fp32 sums;
                                                         bf16 rows on AVX512-BF16 CPUs: bf16
                                                         pair products); more: the
                                                         dequantized weight
    int4    4-bit groups of ``group_size`` inputs along  AVX512-VNNI or AVX2 with FMA:       --
            K, asymmetric: w = (q - 8) * scale + zero    csrc/int4_vnni_cpu.c (activations
                                                         quantized per row in the weight's
                                                         groups).  Elsewhere:
                                                         aten._weight_int4pack_mm_for_cpu
                                                         (bf16 activations)
    fp8     float8 e4m3 per output channel:              the dequantized weight (a check,   torch._scaled_mm, the
            w = q * scale[row]                           not a fast path)                   activations quantized
                                                                                            per row on the fly

The LM head is quantized too: int8 under int8 and int4 (a 4-bit head costs too much quality for
the bytes it saves), fp8 under fp8; a tied embedding shares the head's quantized rows (its lookup
dequantizes the rows it reads), so the model holds one copy of them.  Activations (but for the
int8 and int4 products' own rounding of their inputs on their kernels), norms, the KV cache and
the logits stay in the model's dtype.  Quality is measured, not assumed:
``benchmarks/quant_quality.py``.
"""
from __future__ import annotations

import abc
import ctypes
import logging

import torch
from torch import nn

from common.engine.models import int4_vnni, int8_gemv, int8_vnni
from common.engine.models.int8_gemv import GEMV_MAX_ROWS
from common.engine.models.quantization_scheme import INT4_GROUP_SIZES, QUANTIZATIONS

log = logging.getLogger(__name__)

_FP8_MAX = 448.0  # float8 e4m3's largest finite value


class QuantizedWeight(abc.ABC):
    """A quantized ``[out_features, in_features]`` weight and its product with activations."""

    out_features: int
    in_features: int

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for a 2-D ``x`` in the model's dtype."""

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight these bytes stand for, in the model's dtype (tests and references)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` (an embedding lookup of a tied head)."""
        return self.dequantize()[ids]

    def fused_product(self) -> tuple[str, object, tuple[torch.Tensor, ...], int] | None:
        """``(kind, C entry, weight tensors, group)`` where a C kernel computes ``matmul`` of fp32
        rows that ``common.engine.models.fused_layers`` can call; None (the default) elsewhere."""
        return None

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's first maximal index of ``matmul(x)``, where a kernel finds it without the
        products (an LM head's greedy step); None (the default) elsewhere."""
        return None

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...

    kind: str  # the scheme these bytes are in (``QUANTIZATIONS``)

    @abc.abstractmethod
    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this weight is, as packed (``restore_weight`` rebuilds it from them)."""

    def describe(self) -> dict:
        """What ``restore_weight`` needs besides the tensors (JSON)."""
        return {"kind": self.kind, "out_features": self.out_features, "in_features": self.in_features,
                "dtype": str(self.dtype).removeprefix("torch.")}


INT4_ROW_MULTIPLE = 16  # the int4 kernel packs output channels in groups of this many

def _row_scales(w: torch.Tensor, largest: float) -> torch.Tensor:
    """Per-row symmetric scales (fp32) mapping each row's largest magnitude to ``largest``."""
    return (w.abs().amax(dim=1).float() / largest).clamp(min=1e-12)


class Int8Weight(QuantizedWeight):
    """Per-output-channel int8.  On CPUs with AVX512-VNNI or AVX2 and FMA (and ``vnni``) it is held in
    that kernel's layout alone (``int8_vnni``) and every product takes it: activations quantized per
    row and group of inputs, int8 x int8 sums.  Elsewhere it is packed for ``csrc/int8_gemv_cpu.c``
    (blocks of 8 channels, k-major): up to ``GEMV_MAX_ROWS`` rows (decode batches, sampled rows) take that kernel,
    which streams the int8 bytes once per 8 rows and accumulates in fp32; more rows (prefill
    chunks, compute-bound) dequantize the weight and take the fp32 product, as does a CPU without
    a C compiler.  Either way it is stored (``packed_tensors``) in blocks of 8 channels."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, vnni: bool = True):
        w = weight.detach().float()
        out_features, in_features = w.shape
        scale = _row_scales(w, 127.0)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self._use(self._blocks_of_8(q), scale.contiguous(), out_features, weight.dtype, vnni)

    @staticmethod
    def _blocks_of_8(q: torch.Tensor) -> torch.Tensor:
        """``q`` ``[out, in]`` as ``[ceil(out / 8), in, 8]`` (the last block zero-padded)."""
        out_features, in_features = q.shape
        padded = -(-out_features // 8) * 8
        if padded != out_features:
            q = torch.cat([q, q.new_zeros(padded - out_features, in_features)])
        return q.reshape(padded // 8, 8, in_features).transpose(1, 2).contiguous()

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
                    dtype: torch.dtype, vnni: bool = True) -> "Int8Weight":
        """The weight of ``packed_tensors()`` (``packed`` int8 ``[ceil(out / 8), in, 8]``, ``scale``
        fp32 ``[out]``), checked against that layout."""
        blocks, in_features = -(-out_features // 8), packed.shape[1] if packed.dim() == 3 else -1
        if (packed.dtype != torch.int8 or tuple(packed.shape) != (blocks, in_features, 8)
                or scale.dtype != torch.float32 or tuple(scale.shape) != (out_features,)):
            raise ValueError(f"int8 weight of {out_features} outputs: packed {packed.dtype} {tuple(packed.shape)}, "
                             f"scale {scale.dtype} {tuple(scale.shape)} do not match its layout")
        weight = cls.__new__(cls)
        weight._use(packed.contiguous(), scale.contiguous(), out_features, dtype, vnni)
        return weight

    def _use(self, packed: torch.Tensor, scale: torch.Tensor, out_features: int, dtype: torch.dtype,
             vnni: bool) -> None:
        self.scale = scale  # fp32
        self.out_features, self.in_features, self.dtype = out_features, packed.shape[1], dtype
        on_cpu = packed.device.type == "cpu"
        self._vnni = int8_vnni.kernel() if on_cpu and vnni else None
        if self._vnni is not None:  # that kernel's layout alone: one copy of the bytes
            self._vnni_packed, self._packed = int8_vnni.pack(self._q_of(packed, out_features)), None
            self._gemv = self._gemv_bf16 = None
        else:
            self._vnni_packed, self._packed = None, packed
            self._gemv = int8_gemv.kernel() if on_cpu else None
            self._gemv_bf16 = int8_gemv.bf16_kernel() if self._gemv is not None else None

    @staticmethod
    def _q_of(packed: torch.Tensor, out_features: int) -> torch.Tensor:
        return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]

    @property
    def packed(self) -> torch.Tensor:
        """The weight in blocks of 8 channels, k-major (``[ceil(out / 8), in, 8]``: the stored layout)."""
        return self._packed if self._packed is not None else self._blocks_of_8(self.q)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale": self.scale}

    @property
    def q(self) -> torch.Tensor:
        """The int8 weight as ``[out_features, in_features]``."""
        if self._vnni_packed is not None:
            return int8_vnni.unpack(self._vnni_packed, self.out_features, self.in_features)
        return self._q_of(self._packed, self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._vnni is not None:  # (which checks the rows' width itself)
            y = int8_vnni.product(self._vnni, x, self._vnni_packed, self.scale, self.out_features, self.in_features)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.dim() != 2 or x.shape[1] != self.in_features:  # the C kernel reads rows of in_features
            raise ValueError(f"int8 product: expected rows of {self.in_features} inputs, got {tuple(x.shape)}")
        if x.shape[0] <= GEMV_MAX_ROWS:
            if self._gemv_bf16 is not None and x.dtype == torch.bfloat16:
                a = x.detach().contiguous()
                if self.in_features % 2:  # the kernel reads inputs in pairs
                    a = torch.nn.functional.pad(a, (0, 1))
                return self._kernel_product(self._gemv_bf16, a).to(x.dtype)
            if self._gemv is not None:
                return self._kernel_product(self._gemv, x.detach().float().contiguous()).to(x.dtype)
        return torch.nn.functional.linear(x.float(), self.dequantize().float()).to(x.dtype)

    def fused_product(self) -> tuple[str, object, tuple[torch.Tensor, ...], int] | None:
        """The VNNI kernel's entry and layout (``QuantizedWeight.fused_product``); elsewhere the fp32-sum
        kernel's, which ``matmul`` takes for fp32 rows up to ``GEMV_MAX_ROWS`` (the fused layers take
        no more where it computes); None without either."""
        if self._vnni is not None:
            return "vnni8", self._vnni, (self._vnni_packed, self.scale), int8_vnni.ACTIVATION_GROUP
        if self._gemv is not None:
            return "gemv8", self._gemv, (self._packed, self.scale), 0
        return None

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each fp32 row's first maximal index of ``matmul(x)`` without the products' rows (an LM head's
        greedy tokens; ``int8_vnni.argmax``, or off that kernel the fp32-sum one's ``int8_gemv_argmax`` for
        the rows ``matmul`` gives it), or None: no such kernel, or a product not finite."""
        if x.dtype != torch.float32:
            return None
        if self._vnni is not None:
            entry = int8_vnni.argmax_kernel()
            return None if entry is None else int8_vnni.argmax(entry, x, self._vnni_packed, self.scale,
                                                               self.out_features, self.in_features)
        entry = int8_gemv.argmax_kernel() if self._gemv is not None else None
        if entry is None or x.shape[0] > GEMV_MAX_ROWS:  # (more rows: the dequantized weight's product)
            return None
        return int8_gemv.argmax(entry, x, self._packed, self.scale, self.out_features, self.in_features)

    def _kernel_product(self, kernel, a: torch.Tensor) -> torch.Tensor:
        """``a @ W.T`` in fp32 by one of the C kernel's entries (``a`` in the layout it reads)."""
        y = torch.empty(a.shape[0], self.out_features, dtype=torch.float32)
        kernel(ctypes.c_void_p(a.data_ptr()), a.shape[0], ctypes.c_void_p(self.packed.data_ptr()),
               ctypes.c_void_p(self.scale.data_ptr()), ctypes.c_void_p(y.data_ptr()), self.out_features,
               self.in_features)
        return y

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._vnni_packed is not None and ids.device.type == "cpu" and self.scale.is_contiguous():
            found = int8_vnni.scaled_rows(self._vnni_packed, self.scale, ids, self.out_features, self.in_features)
            if found is not None:
                return found.to(self.dtype)
        if self._vnni_packed is not None:
            q = int8_vnni.unpack_rows(self._vnni_packed, ids, self.in_features)
        else:
            q = self._packed[ids // 8, :, ids % 8]
        return (q.float() * self.scale[ids, None]).to(self.dtype)

    @property
    def nbytes(self) -> int:
        stored = self._vnni_packed if self._vnni_packed is not None else self._packed
        return stored.numel() + self.scale.numel() * 4


class Int4Weight(QuantizedWeight):
    """4-bit groups of ``group_size`` inputs, ``w = (q - 8) * scale + zero``: quantized here from a
    weight, or (``from_groups``) taken as a GGUF file stored them.  On CPUs with AVX512-VNNI or AVX2
    and FMA (and ``vnni``) held in that kernel's layout alone (``int4_vnni``: activations quantized
    per row in the weight's groups, int8 x 4-bit sums); elsewhere PyTorch's int4 kernel's (bf16
    activations).  Either way stored (``packed_tensors``) in PyTorch's layout."""

    kind = "int4"

    def __init__(self, weight: torch.Tensor, group_size: int, vnni: bool = True):
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        w = weight.detach().float()
        out_features, in_features = w.shape
        if in_features % group_size:
            raise ValueError(f"int4: {in_features} inputs do not split into groups of {group_size}")
        groups = w.reshape(out_features, -1, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).reshape(out_features, -1)
        self._pack(q, scale, low + 8.0 * scale, group_size, weight.dtype, vnni)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype, vnni: bool = True) -> "Int4Weight":
        """The weight ``(q - 8) * scale + zero`` as given: ``q`` ``[out, in]`` in 0..15, ``scale`` and
        ``zero`` ``[out, in / group_size]`` (a GGUF's 4-bit blocks, ``common.engine.loading.gguf_blocks``)."""
        weight = cls.__new__(cls)
        weight._pack(q, scale.float(), zero.float(), group_size, dtype, vnni)
        return weight

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              dtype: torch.dtype, vnni: bool = True) -> None:
        out_features, in_features = q.shape
        if out_features % INT4_ROW_MULTIPLE:
            raise ValueError(f"int4: {out_features} outputs are not a multiple of {INT4_ROW_MULTIPLE} "
                             f"(the kernel's packing)")
        self.out_features, self.in_features, self.group_size, self.dtype = out_features, in_features, group_size, dtype
        self._vnni = int4_vnni.kernel() if vnni and q.device.type == "cpu" else None
        if self._vnni is not None:  # that kernel's layout alone: one copy of the bytes
            self._vnni_weight = int4_vnni.pack(q, scale, zero, group_size)
            self._packed = self._scales_and_zeros = None
            return
        # [groups, out_features, 2]: the layout PyTorch's kernel reads, which computes (q - 8) * scale + zero
        self._use_torch_layout(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1),
                               torch.stack([scale.t(), zero.t()], dim=-1).contiguous())

    def _use_torch_layout(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        self._vnni, self._vnni_weight = None, None
        self._packed, self._scales_and_zeros = packed, scales_and_zeros
        self._scales_and_zeros_bf16 = scales_and_zeros.to(torch.bfloat16)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int, in_features: int,
                    group_size: int, dtype: torch.dtype, vnni: bool = True) -> "Int4Weight":
        """The weight of ``packed_tensors()`` (PyTorch's int4 kernel's packed nibbles and ``[groups, out,
        2]`` fp32 scales and zeros), checked against that layout."""
        groups = in_features // group_size if group_size in INT4_GROUP_SIZES else -1
        if (out_features % INT4_ROW_MULTIPLE or groups * group_size != in_features
                or packed.dtype != torch.uint8 or packed.numel() * 2 != out_features * in_features
                or scales_and_zeros.dtype != torch.float32
                or tuple(scales_and_zeros.shape) != (groups, out_features, 2)):
            raise ValueError(f"int4 weight [{out_features}, {in_features}] in groups of {group_size}: packed "
                             f"{packed.dtype} {tuple(packed.shape)}, scales {scales_and_zeros.dtype} "
                             f"{tuple(scales_and_zeros.shape)} do not match its layout")
        weight = cls.__new__(cls)
        weight.out_features, weight.in_features, weight.group_size, weight.dtype = (out_features, in_features,
                                                                                    group_size, dtype)
        weight._use_torch_layout(packed.contiguous(), scales_and_zeros.contiguous())
        if vnni and int4_vnni.kernel() is not None:
            weight._pack(*weight._groups(), group_size, dtype)
        return weight

    def _groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[out, in]`` and fp32 ``scale``, ``zero`` ``[out, groups]`` (from either layout)."""
        if self._vnni_weight is not None:
            return int4_vnni.unpack(*self._vnni_weight)
        scale, zero = self._scales_and_zeros[..., 0].t().contiguous(), self._scales_and_zeros[..., 1].t().contiguous()
        q = _torch_int4_values(self._packed, self.out_features, self.in_features)
        if q is None:  # a PyTorch whose layout is not the one read here: through its kernel (slow)
            log.warning("int4: PyTorch's packed layout is not the expected one; unpacking through its kernel")
            w = self._product(torch.eye(self.in_features), self._scales_and_zeros).t()  # (q - 8) * scale + zero
            spread = self._per_input(scale)  # a group of equal weights has scale 0: any q then
            q = torch.round((w - self._per_input(zero)) / spread.where(spread != 0, 1.0) + 8.0).clamp(0, 15)
        return q, scale, zero

    def _per_input(self, t: torch.Tensor) -> torch.Tensor:
        """A ``[out, groups]`` tensor repeated over each group's inputs: ``[out, in]``."""
        return t.repeat_interleave(self.group_size, dim=1)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        if self._packed is not None:
            return {"packed": self._packed, "scales_and_zeros": self._scales_and_zeros}
        q, scale, zero = self._groups()
        return {"packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1),
                "scales_and_zeros": torch.stack([scale.t(), zero.t()], dim=-1).contiguous()}

    def describe(self) -> dict:
        return {**super().describe(), "group_size": self.group_size}

    def fused_product(self) -> tuple[str, object, tuple[torch.Tensor, ...], int] | None:
        """The VNNI kernel's entry and layout (``QuantizedWeight.fused_product``), or None."""
        if self._vnni is None:
            return None
        return "vnni4", self._vnni, tuple(self._vnni_weight), self.group_size

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._vnni is not None:  # (which checks the rows' width itself)
            y = int4_vnni.product(self._vnni, x, *self._vnni_weight, self.out_features, self.group_size)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"int4 product: expected rows of {self.in_features} inputs, got {tuple(x.shape)}")
        # bf16 in and out: the kernel's fp32 path is far slower on CPUs without AVX-512
        return self._product(x.to(torch.bfloat16), self._scales_and_zeros_bf16).to(x.dtype)

    def _product(self, x: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self._packed, self.group_size,
                                                           scales_and_zeros)

    def dequantize(self) -> torch.Tensor:
        q, scale, zero = self._groups()
        return ((q.float() - 8.0) * self._per_input(scale) + self._per_input(zero)).to(self.dtype)

    @property
    def nbytes(self) -> int:
        if self._vnni_weight is not None:
            nibbles, scale, zero = self._vnni_weight
            return nibbles.numel() + (scale.numel() + zero.numel()) * 4
        return self._packed.numel() + self._scales_and_zeros.numel() * 4


_TORCH_INT4_BLOCKS = (64, 32)  # output channels a block of PyTorch's int4 packing: AVX-512, AVX2


def _torch_int4_values(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor | None:
    """``q`` (uint8 ``[out, in]``) of ``aten._convert_weight_to_int4pack_for_cpu``'s bytes, or None where
    packing it again does not give those bytes back (that layout is PyTorch's, undocumented).  PyTorch
    2.x packs per block of ``BLOCK`` output channels -- 64 on AVX-512 CPUs, 32 on AVX2 ones --, input
    by input, ``BLOCK / 2`` bytes pairing channels j and j + BLOCK / 2, and a last block of fewer
    channels pairing 2j and 2j + 1; each block size is tried."""
    flat = packed.reshape(-1)
    for block in _TORCH_INT4_BLOCKS:
        full, tail = divmod(out_features, block)
        half = block // 2
        blocks = flat[: full * in_features * half].reshape(full, in_features, half)
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=2).permute(0, 2, 1).reshape(full * block, in_features)
        if tail:
            pairs = flat[full * in_features * half :].reshape(in_features, tail // 2)
            q = torch.cat([q, torch.stack([pairs & 0x0F, pairs >> 4], dim=2).reshape(in_features, tail).t()])
        again = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        if torch.equal(again.reshape(-1), flat):
            return q
    return None


class Fp8Weight(QuantizedWeight):
    kind = "fp8"

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        scale = _row_scales(w, _FP8_MAX)
        self._use((w / scale[:, None]).to(torch.float8_e4m3fn).contiguous(), scale.contiguous(), weight.dtype)

    @classmethod
    def from_packed(cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "Fp8Weight":
        """The weight of ``packed_tensors()`` (``q`` e4m3 ``[out, in]``, ``scale`` fp32 ``[out]``)."""
        if (q.dtype != torch.float8_e4m3fn or q.dim() != 2 or scale.dtype != torch.float32
                or tuple(scale.shape) != (q.shape[0],)):
            raise ValueError(f"fp8 weight: q {q.dtype} {tuple(q.shape)}, scale {scale.dtype} {tuple(scale.shape)} "
                             f"do not match its layout")
        weight = cls.__new__(cls)
        weight._use(q.contiguous(), scale.contiguous(), dtype)
        return weight

    def _use(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.q, self.scale, self.dtype = q, scale, dtype  # scale: fp32
        self.out_features, self.in_features = q.shape

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "scale": self.scale}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            x_scale = _row_scales(x, _FP8_MAX)[:, None]
            x_q = (x.float() / x_scale).to(torch.float8_e4m3fn)
            return torch._scaled_mm(x_q, self.q.t(), scale_a=x_scale, scale_b=self.scale[None, :],
                                    out_dtype=x.dtype)
        return torch.nn.functional.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def quantize_weight(weight: torch.Tensor, scheme: str, group_size: int, head: bool = False) -> QuantizedWeight:
    """``weight`` under ``scheme`` (an LM head: int8 under int4, see the module docstring)."""
    if scheme == "int4" and head:
        scheme = "int8"
    if scheme in ("int8", "int4") and weight.device.type != "cpu":
        raise ValueError(f"--quantization {scheme} runs on CPU kernels; on {weight.device.type} use fp8")
    if scheme == "int8":
        return Int8Weight(weight)
    if scheme == "int4":
        return Int4Weight(weight, group_size)
    if scheme == "fp8":
        return Fp8Weight(weight)
    raise ValueError(f"unknown quantization {scheme!r}; expected one of {', '.join(QUANTIZATIONS)}")


def restore_weight(description: dict, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """The weight ``describe()`` and ``packed_tensors()`` were taken from; ``ValueError`` where they
    do not fit together (a cache file from elsewhere, damaged)."""
    try:
        kind, out_features, in_features = description["kind"], description["out_features"], description["in_features"]
        dtype = getattr(torch, description["dtype"])
        if not (isinstance(out_features, int) and isinstance(in_features, int) and isinstance(dtype, torch.dtype)):
            raise TypeError("shape or dtype")
        if kind == "int8":
            weight = Int8Weight.from_packed(tensors["packed"], tensors["scale"], out_features, dtype)
        elif kind == "int4":
            weight = Int4Weight.from_packed(tensors["packed"], tensors["scales_and_zeros"], out_features, in_features,
                                            description["group_size"], dtype)
        elif kind == "fp8":
            weight = Fp8Weight.from_packed(tensors["q"], tensors["scale"], dtype)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"a quantized weight's description {description!r} is incomplete: {exc}") from None
    if (weight.out_features, weight.in_features) != (out_features, in_features):
        raise ValueError(f"a {kind} weight described as [{out_features}, {in_features}] holds "
                         f"[{weight.out_features}, {weight.in_features}]")
    return weight


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` of any leading shape."""
    rows = x.dim() == 2  # a step's tokens: no reshapes (a decode step makes ~70 of these calls)
    flat = weight.matmul(x if rows else x.reshape(-1, x.shape[-1]))
    if bias is not None:
        flat = flat + bias
    return flat if rows else flat.reshape(*x.shape[:-1], weight.out_features)


class QuantizedEmbedding(nn.Module):
    """An embedding whose rows are a (tied) head's quantized weight: a lookup dequantizes the
    rows it reads."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.quantized = weight
        self.num_embeddings = weight.out_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quantized.rows(ids)
