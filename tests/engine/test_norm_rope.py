"""RMSNorm with the residual add or RoPE after it in one kernel call (``common.engine.models.norm_rope``):
the values of the torch code it replaces, where the decoder uses it, and what it refuses."""
from __future__ import annotations

import pytest
import torch

from common.engine.models import norm_rope as fused
from common.engine.models.decoder import RMSNorm
from common.engine.models.rotary import apply_rotary, rotate

needs_kernel = pytest.mark.skipif(fused.kernel() is None, reason="no C compiler for the kernel")
EPS = 1e-6
CLOSE = dict(rtol=2e-6, atol=1e-6)  # the sum of squares is ordered differently: a last bit or two


def reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 640), (16, 640), (7, 33), (2048, 640), (2, 12288)])
def test_a_norm_and_a_norm_added_to_a_residual_equal_torch(shape):
    gen = torch.Generator().manual_seed(shape[0])
    x, residual = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen)
    torch.testing.assert_close(fused.norm_rope(x, weight, EPS), reference_norm(x, weight), **CLOSE)
    torch.testing.assert_close(fused.norm_rope(x, weight, EPS, residual=residual),
                               residual + reference_norm(x, weight), **CLOSE)


@needs_kernel
@pytest.mark.parametrize("tokens,heads", [(1, 1), (3, 4), (40, 2)])
def test_heads_read_in_place_from_a_fused_projection_normed_and_rotated(tokens, heads):
    gen = torch.Generator().manual_seed(tokens * 10 + heads)
    head_dim = 64
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # rows 1.x heads apart: a strided view
    weight = torch.randn(head_dim, generator=gen)
    cos, sin = torch.randn(tokens, head_dim, generator=gen), torch.randn(tokens, head_dim, generator=gen)
    torch.testing.assert_close(fused.norm_rope(q, weight, EPS, cos=cos, sin=sin),
                               apply_rotary(reference_norm(q, weight), cos, sin), **CLOSE)
    assert torch.equal(fused.norm_rope(q, None, cos=cos, sin=sin), apply_rotary(q, cos, sin))  # no reduction
    assert torch.equal(rotate(q, cos, sin), apply_rotary(q, cos, sin))


@needs_kernel
def test_the_decoders_norms_take_the_kernel_eagerly():
    norm = RMSNorm(64, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    cos, sin = torch.randn(5, 64), torch.randn(5, 64)
    with torch.inference_mode():
        called = ops_called(lambda: (norm(x), norm.added_to(residual, x), norm.rotated(x[:, None], cos, sin)))
        assert fused.PROFILER_LABEL in called and "aten::rsqrt" not in called
        torch.testing.assert_close(norm.added_to(residual, x), residual + reference_norm(x, norm.weight), **CLOSE)
        torch.testing.assert_close(norm.rotated(x[:, None], cos, sin),
                                   apply_rotary(reference_norm(x, norm.weight)[:, None], cos, sin), **CLOSE)
        # bf16 activations (a bf16 model: its weight bf16 too) widened to fp32 for the kernel, the
        # result rounded once to bf16: torch's code's values but for the fp32 sum's last bits
        narrow = RMSNorm(64, EPS).bfloat16()
        with torch.no_grad():
            narrow.weight.copy_(torch.linspace(0.5, 1.5, 64))
        for rows in (x.bfloat16(), torch.randn(3, 4, 64).bfloat16()):
            called = ops_called(lambda: narrow(rows))
            assert fused.PROFILER_LABEL in called and "aten::rsqrt" not in called
            out = narrow(rows)
            expected = reference_norm(rows.float(), narrow.weight.float()).bfloat16()
            assert out.dtype == torch.bfloat16 and out.shape == rows.shape
            # rounded once: equal to the reference's rounding but for ties the fp32 last bits decide
            assert (out.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2 ** -8
            assert (out == expected).float().mean() > 0.99
        # inside torch.compile the norm stays torch ops (no graph break: fullgraph; traced here, the
        # compiled engine of test_compile.py has inductor fuse them)
        compiled = torch.compile(lambda t, r: norm.added_to(r, t) * 2, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, residual), (residual + reference_norm(x, norm.weight)) * 2, **CLOSE)


@needs_kernel
def test_operands_that_do_not_fit_are_refused():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="x must be fp32"):
        fused.norm_rope(x.bfloat16(), torch.randn(8), EPS)
    with pytest.raises(ValueError, match="weight"):
        fused.norm_rope(x, torch.randn(7), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.norm_rope(x, torch.randn(8), EPS, residual=torch.randn(2, 8))
    with pytest.raises(ValueError, match="cos and sin"):
        fused.norm_rope(x, None, cos=torch.randn(3, 8))
    with pytest.raises(ValueError, match="sin must be fp32 \\[3, 8\\]"):
        fused.norm_rope(x, None, cos=torch.randn(3, 8), sin=torch.randn(3, 8).double())
    with pytest.raises(ValueError, match="rows of 9 values"):
        fused.norm_rope(torch.randn(3, 9), None, cos=torch.randn(3, 9), sin=torch.randn(3, 9))  # odd: no halves
    assert not fused.applies(x.bfloat16()) and not fused.applies(x.T) and not fused.applies(torch.randn(8))
