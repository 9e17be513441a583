"""The MLPs' activation functions, by a checkpoint's ``hidden_act`` name.

GELU's tanh approximation (Gemma's ``gelu_pytorch_tanh``) is written, inside torch.compile, as
``x * sigmoid(2u)`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)``: the same function, since
``0.5 (1 + tanh u) = sigmoid(2u)``, but through an exponential, which inductor's vector code computes
four times faster than its tanh (a prefill step's 2048 x 2048 activations on 2 cores: 7.0 -> 1.7 ms;
the largest elementwise cost of Gemma 3's prefill).  The two agree to the last few bits (largest
difference from an fp64 reference the same for both).  Eagerly, ``F.gelu`` is one op where the
rewrite would be five.

``gated`` computes a gated MLP's ``act(gate) * up`` from the fused gate/up product's output: for
eager fp32 CPU rows in one call of ``csrc/gated_activation_cpu.c`` (silu and the tanh GELU; also
what ``common.engine.models.fused_layers`` calls), elsewhere as the two torch ops.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch
import torch.nn.functional as F

from common.engine.cpu_kernels import kernel_function

_GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (``F.gelu(x, approximate="tanh")``); see the module docstring."""
    if torch.compiler.is_compiling():
        return x * torch.sigmoid(_GELU_TANH_SCALE * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
}

# The C kernel's activations (its ACT_* codes), by ``hidden_act`` name.
KERNEL_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


@functools.cache  # resolved once: a decode step calls it once a layer
def kernel():
    """The C kernel's entry ``gated_activation(gu, rows, width, s_row, kind, out, threads)``, or None."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("gated_activation_cpu", "gated_activation", [ptr, i64, i64, i64, ctypes.c_int, ptr,
                                                                         ctypes.c_int], ctypes.c_int)


def gated(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    """``act(gate) * up`` where ``gate, up = gate_up.chunk(2, -1)`` (``act``: ``ACTIVATIONS[name]``)."""
    kind = KERNEL_ACTIVATIONS.get(name)
    if (kind is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.dim() != 2
            or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2 or torch.compiler.is_compiling() or kernel() is None):
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[name](gate) * up
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=torch.float32)
    if rows and kernel()(gate_up.data_ptr(), rows, width, gate_up.stride(0), kind, out.data_ptr(),
                         torch.get_num_threads()) != 0:
        raise ValueError(f"gated activation: rows of {width} values are not supported")
    return out
