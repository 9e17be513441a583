"""The decoder's products: oneDNN for few-row CPU fp32 products, ``F.linear`` otherwise, the same values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.models import linear as linear_module
from common.engine.models.linear import ONEDNN_MAX_ROWS, Linear, linear


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("rows", [1, 16, ONEDNN_MAX_ROWS - 1, ONEDNN_MAX_ROWS, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_values_equal_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(64, rows, generator=gen).t()  # not contiguous
    torch.testing.assert_close(linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not linear_module._ONEDNN, reason="this torch has no oneDNN linear")
def test_few_rows_go_to_onednn_many_rows_to_f_linear():
    layer = Linear(64, 96)
    few, many = torch.randn(16, 64), torch.randn(ONEDNN_MAX_ROWS, 64)
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" in ops_called(lambda: layer(few))
        assert "mkldnn::_linear_pointwise" not in ops_called(lambda: layer(many))
        # bf16 and 3-D inputs keep F.linear
        assert "mkldnn::_linear_pointwise" not in ops_called(lambda: linear(few.bfloat16(), layer.weight.bfloat16()))
        assert "mkldnn::_linear_pointwise" not in ops_called(lambda: layer(few[None]))
