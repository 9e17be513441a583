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

**Few rows.** A packed fp32 weight also gets a copy in panels (``common.engine.models.panels``;
a bf16 one on CPUs with AVX512-BF16):
products of up to ``PANEL_MAX_ROWS`` rows, the decode steps', run there (a C kernel that streams
the weights faster than oneDNN for few rows); more rows, and every product inside torch.compile,
stay oneDNN's.

Unpacked weights (other devices, dtypes, or a torch without oneDNN) take ``F.linear``, except CPU
fp32 products with fewer than ``ONEDNN_MAX_ROWS`` rows, which take oneDNN on the plain weight
(MKL's sgemm is slow for few rows on these CPUs, ahead by ~10% for many).

Inside torch.compile (``common.engine.models.stages``) the oneDNN call goes through the custom
op ``pdserve::onednn_linear``: inductor cannot lower ``mkldnn._linear_pointwise`` on symbolic
shapes, and an opaque op keeps the library call while the elementwise work around it is fused.

**Row padding.** oneDNN picks its kernel by the row count, and a few rows can run slower than a
few more: on the 2-core AMD EPYC, the 100m model's products (12 layers and its 32k x 768 head,
packed fp32, one thread) took 26.5 ms for 1 row, 32.8 for 2, 23.7 for 3 and 22.4 for 4 -- the
decode steps of one or two streams were the slowest of all small batches.  ``tune_row_padding``
times a model's own products for 1..8 rows once it is loaded, and where more rows run clearly
faster, fewer are padded with zero rows up to them (``row_padding``: rows -> rows computed; the
padding's results are dropped).  Another CPU, library or thread count gets its own table.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.models import panels as panel_products
from common.engine.models.panels import PanelWeight
from common.engine.models.quantized import QuantizedWeight, quantize_weight, quantized_linear

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


def _linear_pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      row_padding: Sequence[int]) -> torch.Tensor:
    rows = x.shape[0]
    if rows < len(row_padding) and row_padding[rows] > rows:
        padded = x.new_zeros((row_padding[rows], x.shape[1]))
        padded[:rows] = x
        return torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("pdserve::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  row_padding: list[int]) -> torch.Tensor:
    """oneDNN's linear on a contiguous 2-D ``x`` and a plain or packed weight, as an op
    torch.compile keeps opaque (so the row padding sees the real row count)."""
    out = _linear_pointwise(x, weight, bias, row_padding)
    return out if out._base is None else out.clone()  # a custom op's output may not be a view


@onednn_linear.register_fake
def _onednn_linear_shape(x, weight, bias, row_padding):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            row_padding: Sequence[int] = ()) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return onednn_linear(x.contiguous(), weight, bias, list(row_padding))
    return _linear_pointwise(x.contiguous(), weight, bias, row_padding)


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


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  row_padding: Sequence[int] = (), panels: PanelWeight | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` packed by ``pack_weight``; ``x`` of any leading shape;
    ``row_padding`` from ``tune_row_padding``; ``panels``: the same weight packed for few rows
    (``common.engine.models.panels``), which computes the products it applies to."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if panel_products.applies(flat, panels):
        out = panel_products.panel_linear(flat, panels, bias)
    else:
        out = _onednn(flat, packed, bias, row_padding)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], packed.shape[0])


def tune_row_padding(packed: Sequence[torch.Tensor], max_rows: int = 8, repeats: int = 3,
                     margin: float = 0.9) -> tuple[int, ...]:
    """Time products with every weight in ``packed`` (a model's, as packed by ``pack_weight``) for
    1..``max_rows`` rows; returns ``row_padding``: for each row count below ``max_rows + 1`` the
    row count to compute it with -- the fastest of it and more rows, taken only where it beats
    the row count's own time by ``1 - margin`` (timing noise must not choose).  Where nothing
    pays, no padding: ``tuple(range(max_rows + 1))``."""
    inputs = {w.shape[1] for w in packed}

    def pass_seconds(rows: int) -> float:
        xs = {k: torch.randn(rows, k, dtype=packed[0].dtype) for k in inputs}
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms the kernels up
            began = time.perf_counter()
            for w in packed:
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")
            best = min(best, time.perf_counter() - began)
        return best

    with torch.inference_mode():
        seconds = [0.0] + [pass_seconds(rows) for rows in range(1, max_rows + 1)]
    return row_padding_from(seconds, margin)


def row_padding_from(seconds: Sequence[float], margin: float = 0.9) -> tuple[int, ...]:
    """``row_padding`` from ``seconds[rows]``, the time of a pass of products with ``rows`` rows
    (``seconds[0]`` unused): each row count is computed with the fastest of it and more rows where
    that one takes under ``margin`` of its own time."""
    table = [0]
    for rows in range(1, len(seconds)):
        best = min(range(rows, len(seconds)), key=lambda r: seconds[r])
        table.append(best if seconds[best] < margin * seconds[rows] else rows)
    return tuple(table)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on a plain weight, through oneDNN where it is faster (see above)."""
    if (_ONEDNN and x.dim() == 2 and x.shape[0] < ONEDNN_MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is ``linear`` (same parameters, same state-dict names), or,
    after ``pack()``, ``packed_linear`` on its packed weight, or after ``quantize()`` the
    quantized product (``common.engine.models.quantized``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("packed_weight", None, persistent=False)
        self.quantized: QuantizedWeight | None = None
        self.row_padding: tuple[int, ...] = ()  # see tune_row_padding
        self.panels: PanelWeight | None = None  # the packed weight's copy for few rows

    def quantize(self, scheme: str, group_size: int, head: bool = False) -> None:
        """Replace the weight by its quantized form; the plain ``weight`` is emptied."""
        self.use_quantized(quantize_weight(self.weight, scheme, group_size, head))

    def use_quantized(self, weight: QuantizedWeight) -> None:
        """Compute with ``weight`` (which stands for this one); the plain ``weight`` is emptied."""
        self.quantized = weight
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack(self) -> bool:
        """Replace the weight by its packed copy (see the module docstring), and by its panels too
        where they apply (``common.engine.models.panels``); ``False`` (and nothing changed) where
        packing does not apply. The plain ``weight`` is emptied: nothing may read it afterwards."""
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.register_buffer("packed_weight", packed, persistent=False)
        self.panels = panel_products.pack_panels(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized_linear(x, self.quantized, self.bias)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias, self.row_padding, self.panels)
        return linear(x, self.weight, self.bias)
