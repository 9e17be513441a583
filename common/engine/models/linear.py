"""Matrix products of the decoder's projections and LM head.

On CPU in fp32 the product behind ``F.linear`` is MKL's sgemm, which is slow for few rows on
some CPUs (on the AMD EPYC of the development machines a 16-row LM head over a 262k vocabulary
took 189 ms where oneDNN takes 94 ms; the layers' projections gain 10-35% at decode batch sizes).
With many rows (a long prefill chunk) MKL is ahead by about 10%. So CPU fp32 products with fewer
than ``ONEDNN_MAX_ROWS`` rows go to oneDNN's linear, on the plain (unpacked) weight, shared with
everything else that reads it (a tied embedding); everything else goes to ``F.linear``.

Inside torch.compile (``common.engine.models.stages``) the oneDNN call goes through the custom
op ``pdserve::onednn_linear``: inductor cannot lower ``mkldnn._linear_pointwise`` on symbolic
shapes, and an opaque op keeps the library call while the elementwise work around it is fused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MAX_ROWS = 512


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_linear_available()


@torch.library.custom_op("pdserve::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a contiguous 2-D ``x`` and a plain weight, as an op torch.compile keeps opaque."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_shape(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x``, through oneDNN where it is faster (see above)."""
    if (_ONEDNN and x.dim() == 2 and x.shape[0] < ONEDNN_MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32):
        if torch.compiler.is_compiling():
            return onednn_linear(x.contiguous(), weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is ``linear`` (same parameters, same state-dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
