"""Matrix products of the decoder's projections and LM head.

CPU, fp32 and bf16: once loaded, every projection's weight is **packed** into oneDNN's blocked
layout (``pack_weight``: a copy in the layout its kernels stream best; the plain weight is then
dropped) and every product runs oneDNN's linear on it. Measured on the 2-core AMD EPYC of the
development machines (Gemma 3 270M's 18 layers of projections, then its 262k x 640 LM head):

    rows        fp32 F.linear (MKL) / oneDNN plain / oneDNN packed    bf16 F.linear / packed
    8 layers    39.0 / 24.4 / 17.5 ms                                  15.9 / 10.0 ms
    8 head      123 / 43.8 / 25.8 ms                                   33.3 / 12.5 ms
    2048 layers 2490 / 2258 / 2144 ms                                  1106 / 1089 ms

A weight that is read elsewhere too (a tied embedding: its rows are looked up) keeps its plain
copy, and its packed copy costs that much memory again (``DecoderModel.finish_loading``).

Unpacked weights (other devices, dtypes, or a torch without oneDNN) take ``F.linear``, except CPU
fp32 products with fewer than ``ONEDNN_MAX_ROWS`` rows, which take oneDNN on the plain weight
(MKL's sgemm is slow for few rows on these CPUs, ahead by ~10% for many).

Inside torch.compile (``common.engine.models.stages``) the oneDNN call goes through the custom
op ``pdserve::onednn_linear``: inductor cannot lower ``mkldnn._linear_pointwise`` on symbolic
shapes, and an opaque op keeps the library call while the elementwise work around it is fused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MAX_ROWS = 512
# The batch size oneDNN's packed layout is chosen for; the layout serves every row count (decode
# batches and prefill chunks measured alike with hints of 8 and 512).
PACK_ROWS_HINT = 8


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_linear_available()


@torch.library.custom_op("pdserve::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a contiguous 2-D ``x`` and a plain or packed weight, as an op
    torch.compile keeps opaque."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_shape(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return onednn_linear(x.contiguous(), weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A copy of a 2-D CPU fp32/bf16 weight in oneDNN's packed layout, or ``None`` where packing
    does not apply (another device or dtype, no oneDNN) or oneDNN refuses it."""
    if not (_ONEDNN and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16)):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` packed by ``pack_weight``; ``x`` of any leading shape."""
    if x.dim() == 2:
        return _onednn(x, packed, bias)
    return _onednn(x.reshape(-1, x.shape[-1]), packed, bias).reshape(*x.shape[:-1], packed.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on a plain weight, through oneDNN where it is faster (see above)."""
    if (_ONEDNN and x.dim() == 2 and x.shape[0] < ONEDNN_MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is ``linear`` (same parameters, same state-dict names), or,
    after ``pack()``, ``packed_linear`` on its packed weight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("packed_weight", None, persistent=False)

    def pack(self) -> bool:
        """Replace the weight by its packed copy (see the module docstring); ``False`` (and
        nothing changed) where packing does not apply. The plain ``weight`` is emptied: nothing
        may read it afterwards."""
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.register_buffer("packed_weight", packed, persistent=False)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return linear(x, self.weight, self.bias)
