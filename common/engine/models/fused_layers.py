"""Every decoder layer of a small eager fp32 step in one C call: ``csrc/fused_layers_cpu.c``.

A decode step runs each layer as ~15 kernel calls with Python between them (module calls, views,
checks, ctypes conversions): ~5-10 us each, on one core while the other waits, about a quarter of a
Gemma 3 270M int8 step at 8 rows.  ``FusedLayers`` hands the C side the same kernels' entries, the
weights' and the KV cache's addresses once, and then each step's metadata: one call for all the
layers, whose result is the eager forward's to the last bit (the tests compare the two).

It applies (``FusedLayers.build`` returns None otherwise) to a model on the CPU in fp32 on one
rank, a silu or tanh-GELU gated MLP, every projection computed by a C kernel it can call (int8 and
int4 on the VNNI kernels -- their AVX2 builds too; int8 off them on its fp32-sum kernel --, fp32 on
panels), a KV cache in fp32, bf16 or fp8 (``--kv-cache-dtype``: the
new keys and values rounded as torch rounds them), and the CPU attention backend's vector path; and
(``applies``) to steps of up to ``MAX_ROWS`` tokens (larger ones run compiled or eagerly as before), no
more than ``PANEL_MAX_ROWS`` where panels compute (oneDNN takes larger ones) nor ``GEMV_MAX_ROWS`` where
an int8 product is off the VNNI kernels.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from common.engine.attention.backend_cpu import ELEMENT_BYTES, CpuMetadata, CpuPagedAttention, kernel_slots
from common.engine.cpu_kernels import kernel_function, profiled
from common.engine.models import activations, norm_rope
from common.engine.models import panels as panel_products
from common.engine.models.int8_gemv import GEMV_MAX_ROWS

log = logging.getLogger(__name__)

PROFILER_LABEL = "fused_layers"
# Tokens a step may have for the fused layers.  Past the compiled layers' threshold
# (``MIN_COMPILED_TOKENS``) too: on a Xeon with AMX, Gemma 3 270M int8, a decode step of 64 rows
# (~300-token contexts) took 102 ms here against 118 compiled (118 eagerly), a 100-token prompt 135 ms
# against 178 compiled, a 250-token one 205 against 214; a 500-token prompt 328 against 305 compiled
# (one run each): larger steps are left to the compiled layers.
MAX_ROWS = 256
_KINDS = {"vnni8": 0, "vnni4": 1, "panel": 2, "gemv8": 3}  # csrc/fused_layers_cpu.c's PRODUCT_*
_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class _Product(ctypes.Structure):
    _fields_ = [("kind", _I32), ("fn", _PTR), ("w", _PTR * 3), ("bias", _PTR), ("in_", _I64), ("out", _I64),
                ("group", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("input_norm", _PTR), ("post_attention_norm", _PTR), ("pre_feedforward_norm", _PTR),
                ("post_feedforward_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
                ("key_cache", _PTR), ("value_cache", _PTR), ("window", _I32), ("rope", _I32), ("scale", ctypes.c_float)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I32), ("hidden", _I32), ("num_heads", _I32), ("num_kv_heads", _I32),
                ("head_dim", _I32), ("intermediate", _I32), ("activation", _I32), ("sandwich", _I32),
                ("eps", ctypes.c_float), ("block_size", _I32), ("cache_elem", _I32), ("s_block", _I64),
                ("s_slot", _I64), ("s_head", _I64), ("num_blocks", _I64),
                ("norm_rope", _PTR), ("gated_activation", _PTR), ("attention", _PTR), ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("cos", ctypes.POINTER(_PTR)), ("sin", ctypes.POINTER(_PTR)), ("s_cs", _I64), ("slot_blocks", _PTR),
                ("slot_offsets", _PTR), ("table", _PTR), ("query_start", _PTR), ("context_lens", _PTR),
                ("table_stride", _I64), ("num_requests", _I32), ("max_context", _I32), ("threads", _I32)]


@functools.cache
def _entry():
    return kernel_function("fused_layers_cpu", "fused_layers", [_PTR, _PTR, _I64, _PTR], ctypes.c_int)


def _address(fn) -> int:
    return ctypes.cast(fn, _PTR).value


def _product(linear) -> tuple[_Product, bool] | None:
    """``linear``'s product as the C side calls it, and whether it is on panels; None where no C
    kernel it can call computes it."""
    if linear.bias is not None and not _fp32(linear.bias):
        return None
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    if linear.quantized is not None:
        found = linear.quantized.fused_product()
        if found is None:
            return None
        kind, entry, tensors, group = found
        return _Product(_KINDS[kind], _address(entry), (_PTR * 3)(*[t.data_ptr() for t in tensors]), bias,
                        linear.quantized.in_features, linear.quantized.out_features, group), False
    if (linear.panels is not None and linear.panels.dtype == torch.float32
            and panel_products.gemm_entry() is not None):
        p = linear.panels
        return _Product(_KINDS["panel"], _address(panel_products.gemm_entry()), (_PTR * 3)(p.panels.data_ptr()), bias,
                        p.in_features, p.out_features, 0), True
    return None


def _fp32(*tensors) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


class FusedLayers:
    """A model's decoder layers, its KV cache and the CPU attention kernel, set up for
    ``csrc/fused_layers_cpu.c`` (see the module docstring).  Holds what the C side points into."""

    def __init__(self, model: _Model, layers, keep: list, max_rows: int, rope_types: tuple[str, ...], attention):
        self._model, self._layers, self._keep = model, layers, keep
        self.max_rows = max_rows
        self.rope_types = rope_types
        self._attention = attention

    @classmethod
    def build(cls, decoder, cache, attention) -> "FusedLayers | None":
        """For ``decoder`` (a loaded ``DecoderModel``) over ``cache`` with the backend ``attention``,
        or None where it does not apply (the module docstring)."""
        cfg = decoder.cfg
        layers = decoder.model.layers
        keys, values = [cache.key(i) for i in range(len(layers))], [cache.value(i) for i in range(len(layers))]
        cache_elem = ELEMENT_BYTES.get(keys[0].dtype)
        kernels = (_entry(), norm_rope.kernel(), activations.kernel())
        if (any(k is None for k in kernels) or cache_elem is None or decoder.tp.size != 1
                or cfg.hidden_act not in activations.KERNEL_ACTIVATIONS or not isinstance(attention, CpuPagedAttention)
                or not attention.vector_path(4, cache_elem, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)):
            return None
        strides = keys[0].stride()
        if not all(t.dtype == keys[0].dtype and t.device.type == "cpu" and t.stride() == strides
                   for t in keys + values) or strides[-1] != 1:
            return None
        rope_types = tuple(sorted(set(cfg.layer_types)))
        pointer = lambda module: module.weight.data_ptr() if module is not None else None  # noqa: E731
        structs, on_panels = (_Layer * len(layers))(), False
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            products = [_product(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if layer.sandwich else []
            qk_norms = [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
            if any(p is None for p in products) or not _fp32(*[n.weight for n in norms + qk_norms]):
                return None
            on_panels = on_panels or any(panel for _, panel in products)
            structs[i] = _Layer(*[p for p, _ in products], pointer(layer.input_layernorm),
                                pointer(layer.post_attention_layernorm),
                                pointer(getattr(layer, "pre_feedforward_layernorm", None)),
                                pointer(getattr(layer, "post_feedforward_layernorm", None)),
                                pointer(getattr(attn, "q_norm", None)), pointer(getattr(attn, "k_norm", None)),
                                keys[i].data_ptr(), values[i].data_ptr(), attn.window or 0,
                                rope_types.index(attn.layer_type), float(attn.scale))
        model = _Model(len(layers), cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.intermediate_size, activations.KERNEL_ACTIVATIONS[cfg.hidden_act], int(cfg.sandwich_norms),
                       cfg.rms_norm_eps, cache.block_size, cache_elem, strides[0], strides[1], strides[2],
                       keys[0].shape[0], _address(norm_rope.kernel()), _address(activations.kernel()),
                       _address(attention.kernel.paged_attention), structs)
        max_rows = MAX_ROWS
        if any(p.kind == _KINDS["gemv8"] for layer in structs for p in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            max_rows = min(max_rows, GEMV_MAX_ROWS)  # past it those products dequantize the weight
        if on_panels:
            max_rows = min(max_rows, panel_products.PANEL_MAX_ROWS)
        return cls(model, structs, [cache], max_rows, rope_types, attention)

    def applies(self, x: torch.Tensor, meta) -> bool:
        """Whether ``run`` computes this step (fp32 rows on the CPU, few enough, eagerly)."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] <= self.max_rows
                and isinstance(meta, CpuMetadata) and not torch.compiler.is_compiling())

    def run(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        """The hidden states after every layer (a new tensor) for ``x`` [tokens, hidden], the
        step's ``rope`` tables (``layer type -> (cos, sin)``, as ``DecoderModel.forward`` makes them)
        and the attention metadata ``meta``; the new tokens' keys and values go to their slots."""
        out = x.contiguous().clone()
        tables = [rope[t] for t in self.rope_types]
        if not all(_fp32(c, s) and c.shape == (x.shape[0], self._model.head_dim) for c, s in tables):
            raise ValueError("fused layers: cos/sin must be fp32 [tokens, head_dim], contiguous")
        slot_blocks, slot_offsets = kernel_slots(meta.slot_blocks, meta.slot_offsets, x.shape[0], "fused layers")
        step = _Step((_PTR * len(tables))(*[c.data_ptr() for c, _ in tables]),
                     (_PTR * len(tables))(*[s.data_ptr() for _, s in tables]), self._model.head_dim,
                     slot_blocks.data_ptr(), slot_offsets.data_ptr(), meta.block_table.data_ptr(),
                     meta.query_start.data_ptr(), meta.context_lens.data_ptr(), meta.block_table.stride(0),
                     len(meta.query_start) - 1, meta.max_context,
                     self._attention.num_threads or torch.get_num_threads())
        with profiled(PROFILER_LABEL):
            rc = _entry()(ctypes.byref(self._model), out.data_ptr(), out.shape[0], ctypes.byref(step))
        if rc == -4:
            raise IndexError("fused layers: a new token's KV slot outside the cache")
        if rc != 0:
            raise MemoryError("fused layers: scratch allocation failed") if rc == -1 else \
                RuntimeError(f"fused layers: a kernel refused its layout ({rc})")
        return out
