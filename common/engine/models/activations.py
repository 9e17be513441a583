"""The MLPs' activation functions, by a checkpoint's ``hidden_act`` name.

GELU's tanh approximation (Gemma's ``gelu_pytorch_tanh``) is written, inside torch.compile, as
``x * sigmoid(2u)`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)``: the same function, since
``0.5 (1 + tanh u) = sigmoid(2u)``, but through an exponential, which inductor's vector code computes
four times faster than its tanh (a prefill step's 2048 x 2048 activations on 2 cores: 7.0 -> 1.7 ms;
the largest elementwise cost of Gemma 3's prefill).  The two agree to the last few bits (largest
difference from an fp64 reference the same for both).  Eagerly, ``F.gelu`` is one op where the
rewrite would be five.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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
