"""Products of few rows on panel-packed weights (``common.engine.models.panels``): the values of
``F.linear`` for every row count the kernels' tiles take (fp32; bf16 on AVX512-BF16 CPUs), and which
products go there."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.models import panels as panel_products
from common.engine.models.linear import Linear
from common.engine.models.panels import PANEL_MAX_ROWS, pack_panels, panel_linear

pytestmark = pytest.mark.slow(seconds=12)  # a long file: scheduled by its length (tests/conftest.py)

needs_kernel = pytest.mark.skipif(pack_panels(torch.zeros(16, 16)) is None,
                                  reason="no C compiler for the kernel, or no tiles for this CPU (AVX-512 or AVX2 + FMA)")
needs_bf16_kernel = pytest.mark.skipif(pack_panels(torch.zeros(16, 16, dtype=torch.bfloat16)) is None,
                                       reason="no C compiler for the kernel, or a CPU without AVX512-BF16")


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (1000, 333), (7, 5), (16 * 9, 40), (33, 1)])
@pytest.mark.parametrize("rows", [*range(1, PANEL_MAX_ROWS + 1), 21, 40])
def test_values_equal_f_linear_for_every_tile_shape(out_features, in_features, rows):
    """Few rows take the small tiles (AVX-512: 4 panels by up to 4 rows; AVX2: 2 panels by up to
    3), more rows the large ones (2 panels by up to 12 rows; 1 panel by up to 6), several tiles a
    group from 13 (7) rows on; an output count that is not a multiple of 16 ends in a partial panel
    and a partial group (one panel at a time, by up to 16 (6) rows)."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = pack_panels(weight)
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(panel_linear(x, packed), expected, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_strided_inputs_a_bias_and_a_transposed_weight():
    gen = torch.Generator().manual_seed(3)
    weight_t = torch.randn(64, 96, generator=gen)  # weight = weight_t.T: not contiguous
    bias = torch.randn(96, generator=gen)
    wide = torch.randn(5, 200, generator=gen)
    x = wide[:, 10:74]  # rows 200 floats apart
    out = panel_linear(x, pack_panels(weight_t.T), bias)
    torch.testing.assert_close(out, F.linear(x, weight_t.T, bias), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="features"):
        panel_linear(torch.randn(2, 63), pack_panels(weight_t.T))


def test_only_2d_fp32_or_bf16_cpu_weights_are_packed():
    assert pack_panels(torch.randn(8, 4).half()) is None
    assert pack_panels(torch.randn(2, 3, 4)) is None
    assert pack_panels(torch.randn(2, 3, 4).bfloat16()) is None
    assert pack_panels(torch.empty(0, 4)) is None


@needs_kernel
def test_a_packed_layer_takes_panels_for_few_fp32_rows_and_onednn_beyond():
    layer = Linear(64, 96, bias=True)
    x = torch.randn(PANEL_MAX_ROWS + 1, 64)
    with torch.inference_mode():
        expected = layer(x)
        assert layer.pack() and layer.panels is not None
        few, many = x[:PANEL_MAX_ROWS], x
        called = ops_called(lambda: layer(few))
        assert panel_products.PROFILER_LABEL in called and "mkldnn::_linear_pointwise" not in called
        called = ops_called(lambda: layer(many))
        assert panel_products.PROFILER_LABEL not in called and "mkldnn::_linear_pointwise" in called
        torch.testing.assert_close(layer(few), expected[:PANEL_MAX_ROWS], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(layer(few[None]), expected[None, :PANEL_MAX_ROWS], rtol=1e-5, atol=1e-4)
        # inside torch.compile the panels stay out (traced here; test_linear.py compiles it with inductor)
        compiled = torch.compile(lambda t: layer(t) * 2, dynamic=True, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(few), expected[:PANEL_MAX_ROWS] * 2, rtol=1e-5, atol=1e-4)


def test_without_tiles_for_the_cpu_the_products_stay_onednn(monkeypatch):
    monkeypatch.setattr(panel_products, "native", lambda: False)
    assert pack_panels(torch.randn(96, 64)) is None
    layer = Linear(64, 96)
    if layer.pack():  # oneDNN's packed weight, no panels
        assert layer.panels is None
        with torch.inference_mode():
            assert "mkldnn::_linear_pointwise" in ops_called(lambda: layer(torch.randn(2, 64)))


def small_integers(shape, gen, scale: float = 1.0) -> torch.Tensor:
    """bf16 integers in [-15, 15] times ``scale``: their products and sums are exact in fp32."""
    return (torch.randint(-15, 16, shape, generator=gen).float() * scale).bfloat16()


@needs_bf16_kernel
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (1000, 333), (7, 5), (16 * 9, 40), (33, 1), (47, 20)])
@pytest.mark.parametrize("rows", [*range(1, PANEL_MAX_ROWS + 1), 40])
def test_bf16_values_are_the_exact_sums_and_bias_rounded_once(out_features, in_features, rows):
    """Integer values make every fp32 sum exact, so each output must be the exact sum plus the bias
    rounded once to bf16, bit for bit -- a pair in the wrong order, an odd input count's padding, a
    partial panel's columns or a bias added after the rounding would change some.  The tiles are the
    fp32 kernel's (4 panels by up to 4 rows, 2 by up to 12, the partial group 1 by up to 16)."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = small_integers((out_features, in_features), gen)
    x = small_integers((rows, in_features), gen, scale=4.0)
    bias = small_integers((out_features,), gen, scale=64.0)
    packed = pack_panels(weight)
    assert packed.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    strided = torch.cat([x, x[:, :3]], dim=1)[:, :in_features]  # rows in_features + 3 values apart
    for rows_in, b in ((x, None), (x, bias), (strided, bias)):
        out = panel_linear(rows_in, packed, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        expected = (exact + (b.double() if b is not None else 0.0)).float().bfloat16()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@needs_bf16_kernel
def test_a_packed_bf16_layer_takes_panels_for_few_bf16_rows_and_onednn_beyond():
    gen = torch.Generator().manual_seed(5)
    bf16_rows = panel_products.max_rows(torch.bfloat16)  # fewer on CPUs with AMX (oneDNN's tiles)
    layer = Linear(64, 96, bias=True).bfloat16()
    x = torch.randn(bf16_rows + 1, 64, generator=gen).bfloat16()
    with torch.inference_mode():
        expected = (x.double() @ layer.weight.double().T + layer.bias.double()).float()
        assert layer.pack() and layer.panels is not None and layer.panels.dtype == torch.bfloat16
        few = x[:bf16_rows]
        called = ops_called(lambda: layer(few))
        assert panel_products.PROFILER_LABEL in called and "mkldnn::_linear_pointwise" not in called
        called = ops_called(lambda: layer(x))
        assert panel_products.PROFILER_LABEL not in called and "mkldnn::_linear_pointwise" in called
        torch.testing.assert_close(layer(few).float(), expected[:bf16_rows], rtol=8e-3, atol=1e-2)
        # fp32 rows do not take bf16 panels (nor bf16 rows fp32 ones)
        assert not panel_products.applies(few.float(), layer.panels)
        with pytest.raises(ValueError, match="features"):
            panel_linear(few.float(), layer.panels)


@needs_bf16_kernel
def test_the_screened_greedy_head_takes_fp32_panels_only():
    """The screen's exact pass is the fp32 panels' product: bf16 panels give no screened head."""
    from common.engine.models.greedy_head import GreedyHead

    assert GreedyHead.build(pack_panels(torch.randn(64, 32).bfloat16())) is None


@needs_bf16_kernel
def test_a_bf16_model_decodes_on_its_panels_with_onednn_s_values(tmp_path):
    """A bf16 model (tiny Gemma 3) packs its projections and head in bf16 panels, a decode step runs
    its products there, and its logits are oneDNN's but for the rounding of differently ordered sums."""
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from tests.support.checkpoints import tiny_gemma3_config, write_checkpoint

    engine = Engine(EngineConfig(model=str(write_checkpoint(tiny_gemma3_config(), tmp_path)), dtype="bfloat16",
                                 num_blocks=32, block_size=4, max_num_batched_tokens=256), load_tokenizer=False)
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.panels is not None]  # an untied head too
    assert layers and all(m.panels.dtype == torch.bfloat16 for m in layers)
    engine.add_request([5, 9, 3, 7, 2], {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
    engine.step()  # the prompt
    assert panel_products.PROFILER_LABEL in ops_called(engine.step)  # a decode step
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        on_panels = model.logits(hidden)
        for m in layers:
            m.panels = None
        model.lm_head_panels = None  # a tied head's
        on_onednn = model.logits(hidden)
    torch.testing.assert_close(on_panels, on_onednn, rtol=1.6e-2, atol=1e-2)


def test_kernel_calls_are_labelled_for_the_profiler_only_while_one_runs(monkeypatch):
    """A profiler range costs ~10 us to enter: kernel calls open one only under a profiler."""
    from common.engine import cpu_kernels

    opened = []
    record_function = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda label: opened.append(label) or record_function(label))

    def kernel_call():
        with cpu_kernels.profiled("kernel"):
            torch.ones(2).add_(1)

    kernel_call()
    assert opened == []
    assert "kernel" in ops_called(kernel_call)
    assert opened == ["kernel"]
