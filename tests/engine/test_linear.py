"""The decoder's products: packed oneDNN weights on CPU, oneDNN for few-row plain fp32 products, ``F.linear`` otherwise; the same values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.models import linear as linear_module
from common.engine.models.linear import ONEDNN_MAX_ROWS, Linear, linear
from common.engine.models.panels import max_rows

pytestmark = pytest.mark.slow(seconds=38)  # a long file: scheduled by its length (tests/conftest.py)


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


needs_onednn = pytest.mark.skipif(not linear_module._ONEDNN, reason="this torch has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (16,), (700,), (3, 5)])
def test_packed_layer_computes_what_the_plain_one_did(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape) * 1000 + shape[0])
    layer = Linear(64, 96, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=gen))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(*shape, 64, generator=gen).to(dtype)
    expected = F.linear(x.float(), weight.float(), bias.float())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    if dtype == torch.bfloat16 and linear_module.pack_weight(weight) is None:
        # oneDNN refuses to pack bf16 on a CPU without bf16 instructions (AVX2 only): the layer
        # says so, keeps its plain weight and computes the same values.
        assert not layer.pack() and layer.packed_weight is None and layer.weight.numel() == 96 * 64
        torch.testing.assert_close(layer(x).float(), expected, **tol)
        return
    assert layer.pack()
    assert layer.weight.numel() == 0  # the plain copy is gone; only the packed one is read
    with torch.inference_mode():
        out = layer(x)
        few_rows = x.numel() // 64 <= max_rows(dtype) and layer.panels is not None  # bf16 ones: AVX512-BF16 CPUs
        assert ("panel_gemm" if few_rows else "mkldnn::_linear_pointwise") in ops_called(lambda: layer(x))
    assert out.shape == (*shape, 96) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **tol)


def test_weights_that_cannot_be_packed_stay_plain():
    for layer in (Linear(8, 4).half(), Linear(8, 4, device="meta")):
        before = layer.weight
        assert not layer.pack()
        assert layer.weight is before and layer.packed_weight is None
    assert linear_module.pack_weight(torch.randn(2, 3, 4)) is None


@needs_onednn
def test_packed_weight_inside_torch_compile():
    layer = Linear(64, 96)
    x = torch.randn(70, 64)
    with torch.inference_mode():
        expected = layer(x)
        layer.pack()
        compiled = torch.compile(lambda t: torch.relu(layer(t)) * 2, dynamic=True, fullgraph=True)
        torch.testing.assert_close(compiled(x), torch.relu(expected) * 2, rtol=1e-5, atol=1e-5)


def test_row_padding_takes_more_rows_only_where_they_run_clearly_faster():
    from common.engine.models.linear import row_padding_from

    # The 100m model's products on the 2-core EPYC (ms per pass, by row count 1..8).
    measured = [0.0, 26.5, 32.8, 23.7, 22.4, 22.7, 23.2, 27.4, 29.3]
    assert row_padding_from(measured) == (0, 4, 4, 3, 4, 5, 6, 7, 8)
    assert row_padding_from([0.0] + [10.0] * 8) == tuple(range(9))  # nothing gains: no padding
    assert row_padding_from([0.0, 10.0, 9.5, 12.0]) == (0, 1, 2, 3)  # within the margin: noise


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_padded_rows_compute_the_same_values_eager_and_compiled(rows):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(64, 96, bias=True)
    x = torch.randn(rows, 64, generator=gen)
    with torch.inference_mode():
        expected = layer(x)
        assert layer.pack()
        layer.panels = None  # oneDNN's products of few rows (common.engine.models.panels takes them otherwise)
        layer.row_padding = (0, 4, 4, 3, 4, 5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            out = layer(x)
        shapes = [event.input_shapes[0] for event in prof.key_averages(group_by_input_shape=True)
                  if event.key == "mkldnn::_linear_pointwise"]
        assert shapes == [[layer.row_padding[rows], 64]]  # the rows oneDNN computed
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(lambda t: torch.relu(layer(t)) * 2, dynamic=True, fullgraph=True)
        torch.testing.assert_close(compiled(x), torch.relu(expected) * 2, rtol=1e-5, atol=1e-5)
