"""The screened greedy head (common/engine/models/greedy_head.py, csrc/greedy_screen_cpu.c): each
row's token is the first maximal index of the fp32 panels' product, on each pass-1 path the CPU
has (AMX tiles, AVX-512, AVX2), for near ties that bf16 cannot tell apart and exact ties;
values that are not finite leave the decision to the caller.  Sampled rows (softmax(logits / T)) are
drawn by rejection sampling against the screen's bounds: their tokens follow the softmax of the
fp32 logits.  The engine takes it on greedy and plainly sampled unseeded steps only."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.engine.models.greedy_head import GreedyHead, screen_path, uniforms_per_row
from common.engine.models.panels import pack_panels, panel_linear

pytestmark = pytest.mark.skipif(GreedyHead.build(pack_panels(torch.ones(16, 16))) is None,
                                reason="the screen has no vector code for this CPU (AVX-512 or AVX2 with FMA)")

PATHS = ["amx", "avx512", "avx2"]


@pytest.fixture(params=PATHS)
def path(request):
    chosen = screen_path(allow_amx=request.param == "amx")
    if chosen != request.param:
        screen_path(allow_amx=True)
        pytest.skip(f"no {request.param} path on this machine")
    yield chosen
    screen_path(allow_amx=True)


def reference(x: torch.Tensor, panels) -> torch.Tensor:
    return panel_linear(x, panels).max(dim=-1).indices


@st.composite
def heads(draw):
    """A head whose best rows for the drawn inputs have rivals closer than bf16 resolves: copies of
    one row nudged by a few fp32 ulps (or not at all: exact ties) or by about bf16's resolution,
    scattered over the rows."""
    seed = draw(st.integers(0, 2**31 - 1))
    rows = draw(st.integers(1, 300))
    width = draw(st.integers(1, 80))
    tokens = draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, width, generator=g) * draw(st.sampled_from([1e-3, 0.05, 1.0, 30.0]))
    x = torch.randn(tokens, width, generator=g) * draw(st.sampled_from([1e-2, 1.0, 50.0]))
    base = weight[int(torch.randint(rows, (1,), generator=g))].clone()
    for row in torch.randint(rows, (draw(st.integers(0, 12)),), generator=g).tolist():
        nudge = draw(st.sampled_from(["ulp", "ulp", "bf16"]))
        if nudge == "ulp":  # the same bf16 copy (or the same row: an exact tie)
            ulps = draw(st.integers(-3, 3))
            weight[row] = base if ulps == 0 else torch.nextafter(base, torch.full_like(base, ulps * float("inf")))
        else:  # changed by about bf16's resolution: its copy rounds elsewhere, its fp32 logit is close
            eps = draw(st.sampled_from([2.0**-12, 2.0**-9, 2.0**-7]))
            weight[row] = base * (1 + eps * torch.randn(width, generator=g))
    if draw(st.booleans()):  # inputs that favour the copied row
        x[: tokens // 2 + 1] = base * draw(st.sampled_from([1.0, -1.0, 1e3]))
    return weight, x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=heads())
def test_the_token_is_the_fp32_products_first_maximum(path, case):
    weight, x = case
    panels = pack_panels(weight)
    head = GreedyHead.build(panels)
    got = head.argmax(x)
    assert got is not None
    assert torch.equal(got, reference(x, panels))


@pytest.fixture(scope="module")
def wide_head():
    """A 262k-row head at Gemma 3's width (built once: packing it takes seconds)."""
    g = torch.Generator().manual_seed(262)
    panels = pack_panels(torch.randn(262_144, 640, generator=g) * 0.05)
    return GreedyHead.build(panels), panels


def test_a_wide_head_computes_few_rows_in_fp32(path, wide_head):
    """The tokens agree at every batch size (AMX tiles are 16 tokens: partial tiles too), and only a
    few panels per token are computed in fp32 (the point of the screen)."""
    head, panels = wide_head
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 3, 5, 16, 17, 64):
        x = torch.randn(tokens, 640, generator=g) * 3
        before = head.exact_rows
        assert torch.equal(head.argmax(x), reference(x, panels)), tokens
        assert 0 < head.exact_rows - before <= tokens * 16 * 64, tokens


def test_rows_that_are_not_finite_are_left_to_the_caller(path):
    panels = pack_panels(torch.randn(100, 32))
    head = GreedyHead.build(panels)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(3, 32)
        x[1, 5] = bad
        assert head.argmax(x) is None
    assert head.fallbacks == 2
    huge = torch.full((1, 32), 3e38)  # finite, but the logits overflow
    assert head.argmax(huge) is None


def test_an_approximation_that_overflows_where_fp32_does_not_is_computed_in_fp32(path):
    """x = 2^64 and a row (w, -w) with w just below 2^64: bf16 rounds w up to 2^64, so the
    approximate logit is inf - inf (NaN), while fp32 computes 0 -- the largest logit.  Its panel
    must be computed, not dropped for want of a bound."""
    w = 2.0**64 - 2.0**54
    weight = torch.full((40, 2), -1.0)
    weight[5] = torch.tensor([w, -w])
    weight[20] = torch.tensor([-1e-19, 0.0])  # -1.8: the best row whose approximation is finite
    x = torch.full((3, 2), 2.0**64)
    panels = pack_panels(weight)
    assert torch.equal(reference(x, panels), torch.tensor([5, 5, 5]))
    assert torch.equal(GreedyHead.build(panels).argmax(x), torch.tensor([5, 5, 5]))


def test_a_subnormal_input_the_dot_product_flushes_is_within_the_bound(path):
    """x = (1e-39, 2^-110): the bf16 dot product treats the subnormal 1e-39 as zero, which costs
    row A = (1e38, 0) its whole logit 0.1; row B = (0, 2^105) computes 2^-5 almost exactly.  A is
    the maximum, so the bound must count the flush (the copy holds zero, |x - x~| counts it)."""
    weight = torch.full((40, 2), -1.0)
    weight[3] = torch.tensor([1e38, 0.0])
    weight[30] = torch.tensor([0.0, 2.0**105])
    x = torch.tensor([[1e-39, 2.0**-110]])
    panels = pack_panels(weight)
    assert int(reference(x, panels)) == 3
    assert GreedyHead.build(panels).argmax(x).tolist() == [3]


def test_an_odd_k_copy_that_rounds_past_its_rival_is_within_the_bound(path):
    """AVX2 takes an odd k's copy as all 32 bits of its pair, the even k's bf16 as the low half:
    row B's even k (2^-95, bf16 bits 0x1000) pushes its odd k's copy of 1 - 2^-22 up to ~1.0005,
    above row A's copy of 1 + 2^-22 (1.0), though A's logit is the larger.  The bound must count
    what the odd copy is (on the other paths both copies are 1.0: a tie the bound settles)."""
    weight = torch.full((40, 2), -1.0)
    weight[0] = torch.tensor([0.0, 1 + 2.0**-22])
    weight[16] = torch.tensor([2.0**-95, 1 - 2.0**-22])
    x = torch.tensor([[0.0, 1.0]])
    panels = pack_panels(weight)
    assert int(reference(x, panels)) == 0
    assert GreedyHead.build(panels).argmax(x).tolist() == [0]


def test_an_input_that_bf16_would_reorder_is_within_the_bound(path):
    """x0 > 3 x1 by 2^-18, but in bf16 x0 rounds down to 1.0 and x1 to 171/512, so 3 x1~ > x0~:
    row B = (0, 3) beats row A = (1, 0) in bf16.  The paths that round x must count it (AVX2 takes x
    as it is, and the bound must not count less than what its products see)."""
    x0 = 1 + 2.0**-8 - 2.0**-20
    x = torch.tensor([[x0, (x0 - 2.0**-18) / 3]])
    weight = torch.full((40, 2), -1.0)
    weight[0] = torch.tensor([1.0, 0.0])
    weight[16] = torch.tensor([0.0, 3.0])
    panels = pack_panels(weight)
    assert int(reference(x, panels)) == 0
    assert x.to(torch.bfloat16).float()[0, 0] < 3 * x.to(torch.bfloat16).float()[0, 1]
    assert GreedyHead.build(panels).argmax(x).tolist() == [0]


def test_a_head_that_is_not_finite_gets_no_screen():
    weight = torch.randn(40, 16)
    weight[7, 3] = float("nan")
    assert GreedyHead.build(pack_panels(weight)) is None
    weight[7, 3] = 0.0
    weight[7, 2] = 3.4e38  # finite in fp32, infinite in bf16 (an even k: AVX2's odd k are not bf16)
    assert GreedyHead.build(pack_panels(weight)) is None


def test_the_input_must_be_fp32_of_the_heads_width():
    head = GreedyHead.build(pack_panels(torch.randn(40, 16)))
    with pytest.raises(ValueError, match="fp32"):
        head.argmax(torch.randn(2, 15))
    with pytest.raises(ValueError, match="fp32"):
        head.argmax(torch.randn(2, 16, dtype=torch.float64))
    assert head.argmax(torch.randn(0, 16)).shape == (0,)


def sampling_head():
    """A head whose first panel's rows have large bounds beside small logits (x is nearly orthogonal
    to them: |x| |w - w~| ~ 1), so its proposals are often rejected: a sampler that accepted every
    proposal, or drew the row inside a panel by anything but its fp32 logits, would be far off."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 8, generator=g) * 0.5
    weight[:16, 0] = 25.3 + 0.01 * torch.randn(16, generator=g)
    weight[:, 1] = 0.05 * torch.randn(64, generator=g)
    x = torch.randn(1, 8, generator=g) * 0.5
    x[0, 0], x[0, 1] = 0.0, 20.0
    return pack_panels(weight), x


def draw(head, x, temperature, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return head.sample(x.expand(n, x.shape[1]).contiguous(), torch.full((n,), 1 / temperature),
                       torch.rand(n, uniforms_per_row(), dtype=torch.float64, generator=g))


def test_sampled_rows_follow_the_softmax_of_the_fp32_logits(path):
    panels, x = sampling_head()
    head = GreedyHead.build(panels)
    n = 20_000
    tokens = draw(head, x, 1.0, n)
    assert tokens is not None
    p = torch.softmax(panel_linear(x, panels)[0].double(), -1)
    counts = torch.bincount(tokens, minlength=64).double()
    expected = p * n
    chi2 = float((((counts - expected) ** 2) / expected).sum())
    assert chi2 < 63 + 8 * (2 * 63) ** 0.5, chi2  # 63 degrees of freedom; p ~ 1e-9 at the limit
    share, true_share = float(counts[:16].sum()) / n, float(p[:16].sum())
    assert abs(share - true_share) < 4 * (true_share * (1 - true_share) / n) ** 0.5
    assert head.sampled_rows == n and n < head.sample_trials < 16 * n  # some proposals were rejected


def test_greedy_and_sampled_rows_share_a_call(path):
    g = torch.Generator().manual_seed(2)
    panels = pack_panels(torch.randn(300, 24, generator=g))
    x = torch.randn(5, 24, generator=g) * 2
    head = GreedyHead.build(panels)
    inverse = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0])
    tokens = head.sample(x, inverse, torch.rand(5, uniforms_per_row(), dtype=torch.float64, generator=g))
    reference_tokens = reference(x, panels)
    assert tokens[[0, 2, 4]].tolist() == reference_tokens[[0, 2, 4]].tolist()
    assert all(0 <= t < 300 for t in tokens.tolist()) and head.sampled_rows == 2


def test_a_sampled_row_no_trial_decides_is_left_to_the_caller(path):
    """At T = 0.3 the first panel's bounds (~4 in units of T) make most of its proposals fail:
    among 20000 rows some run out of trials (~1% here); those alone are marked -1 for the logits
    path, and the call still returns the others."""
    panels, x = sampling_head()
    head = GreedyHead.build(panels)
    tokens = draw(head, x, 0.3, 20_000)
    undecided = int((tokens == -1).sum())
    assert 0 < undecided < 2_000 and head.undecided_rows == undecided and head.fallbacks == 0
    assert bool(((tokens >= 0) & (tokens < 64) | (tokens == -1)).all())
    bad = x.clone()
    bad[0, 3] = float("nan")
    assert draw(head, bad, 1.0, 1) is None


def test_sampling_inputs_are_checked():
    head = GreedyHead.build(pack_panels(torch.randn(40, 16)))
    x = torch.randn(2, 16)
    uniforms = torch.rand(2, uniforms_per_row(), dtype=torch.float64)
    with pytest.raises(ValueError, match="inverse temperatures"):
        head.sample(x, torch.ones(3), uniforms)
    with pytest.raises(ValueError, match="uniforms"):
        head.sample(x, torch.ones(2), uniforms.float())
