"""Sampler: greedy, temperature, top-k, top-p, min-p, penalties, seeds, logprobs, robustness.

Distributions are checked against a dense reference written the obvious way (sort, cumsum), by
sampling many identical rows in one batch: the batched sampler must agree with it in support and,
within sampling noise, in frequencies.
"""
import math

import msgspec
import pytest
import torch

from common.cluster.messages import GenerateRequest, decode
from common.engine import inverse_cdf
from common.engine import sampler as sampler_module
from common.engine.inverse_cdf import seeded_uniform
from common.engine.sampler import (SCREEN_MIN_TEMPERATURE, Sampler, SamplingRow, sample,
                                   screen_inverse_temperatures)
from common.engine.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")


def logits_row(values):
    return torch.tensor([values], dtype=torch.float32)


def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt=(), output=()) -> torch.Tensor:
    """vLLM's order: penalties, temperature, min-p, top-k, top-p (relative to what top-k kept)."""
    x = logits.double().clone()
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * list(output).count(t) + p.presence_penalty
    probs = torch.softmax(x / p.temperature, -1)
    probs[probs < p.min_p * probs.max()] = 0
    values, order = probs.sort(descending=True, stable=True)
    if 0 < p.top_k < len(values):
        values[values < values[p.top_k - 1]] = 0  # vLLM masks below the k-th: ties with it stay
    mass = values.sum()
    before = values.cumsum(-1) - values
    values[before >= p.top_p * mass] = 0
    out = torch.zeros_like(probs)
    out[order] = values
    return out / out.sum()


def empirical(logits: torch.Tensor, p: SamplingParams, rows: int, **history) -> torch.Tensor:
    """Frequencies of ``rows`` unseeded draws of one logits row, sampled as one batch."""
    batch = logits.expand(rows, -1).contiguous()
    sampled = [SamplingRow(p, 0, history.get("prompt", ()), history.get("output", ())) for _ in range(rows)]
    tokens, _ = Sampler()(batch, sampled)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / rows


# ---- greedy and the filters ----------------------------------------------------------------------


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    tokens, _ = sample(logits, [SamplingParams(temperature=0)] * 2, [0, 0])
    assert tokens == [1, 0]


def test_greedy_ties_take_the_first_maximum_over_a_large_vocabulary():
    """As transformers' ``argmax`` does, whichever thread of the reduction finds which copy first."""
    vocab = 262_144
    logits = torch.randn(6, vocab)
    for row, positions in enumerate([(5, vocab - 1), (vocab // 2, vocab // 2 + 1), (0, 1, vocab - 1),
                                     (70_000, 200_000), (vocab - 2, vocab - 1), (131_071, 131_072)]):
        for position in positions:
            logits[row, position] = 10.0
    mixed = [SamplingParams(temperature=0)] * 5 + [SamplingParams(temperature=1.0, top_k=1)]
    tokens, _ = sample(logits, mixed, [0] * 6)
    assert tokens == [5, vocab // 2, 0, 70_000, vocab - 2, 131_071]


def test_top_k_one_and_a_tiny_top_p_are_greedy_whatever_the_temperature():
    torch.manual_seed(1)
    logits = torch.randn(8, 3000) * 2
    greedy = logits.argmax(-1).tolist()
    for seed in range(10):
        assert sample(logits, [SamplingParams(temperature=2.0, top_k=1, seed=seed)] * 8, [0] * 8)[0] == greedy
        assert sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6, seed=seed)] * 8, [0] * 8)[0] == greedy


def test_top_p_keeps_only_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seen = set(sample(probs.log()[None].expand(400, -1), [SamplingParams(top_p=0.7)] * 400, [0] * 400)[0])
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut


def test_min_p_drops_tokens_below_its_share_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seen = set(sample(probs.log()[None].expand(400, -1), [SamplingParams(min_p=0.2)] * 400, [0] * 400)[0])
    assert seen == {0, 1, 2}  # 0.05 < 0.2 * 0.5


def test_top_k_keeps_the_tokens_tied_with_its_kth():
    """Logits [2, 1, 1, 1, 0] under top_k=2 keep tokens 0-3, as vLLM's mask below the 2nd logit does
    (ties are common where logits come out of a bf16 product)."""
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])
    params = SamplingParams(top_k=2)
    expected = reference_probs(logits, params)
    assert expected[1:4].min() > 0 and expected[4] == 0
    observed = empirical(logits[None], params, 4000)
    assert set(observed.nonzero()[:, 0].tolist()) == {0, 1, 2, 3}
    assert_same_distribution(observed, expected)
    # The last of the kept tokens (in descending order, ties by column) is what u near 1 draws.
    assert Sampler()(logits[None], [SamplingRow(params, uniform=0.999)])[0] == [3]


def test_top_k_ties_are_kept_on_the_group_path_too():
    """A top_k within the 64-column groups' count takes the group-maxima threshold: ties with the
    k-th there, in other groups, stay too."""
    logits = torch.full((2500,), -8.0)
    logits[10] = 3.0
    tied = [70, 700, 1300, 2400]  # four groups apart
    logits[tied] = 2.0
    params = SamplingParams(top_k=3)
    expected = reference_probs(logits, params)
    assert set(expected.nonzero()[:, 0].tolist()) == {10, *tied}
    observed = empirical(logits[None], params, 4000)
    assert set(observed.nonzero()[:, 0].tolist()) == {10, *tied}
    assert_same_distribution(observed, expected)


CASES = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(top_k=5),
    "top_k_above_groups": SamplingParams(top_k=60, temperature=1.5),
    "top_p": SamplingParams(top_p=0.9, temperature=0.7),
    "top_k_and_top_p": SamplingParams(top_k=8, top_p=0.6),
    "min_p": SamplingParams(min_p=0.05, temperature=1.3),
    "all_three": SamplingParams(top_k=20, top_p=0.8, min_p=0.01),
    "penalties": SamplingParams(top_p=0.95, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3),
}


@pytest.mark.parametrize("case", CASES)
def test_batched_sampling_matches_the_dense_reference(case):
    # 2500 columns: two full 1024-column blocks and a tail; 39 groups of 64 columns (top_k=60 > 39
    # takes the other candidate path).
    assert inverse_cdf.BLOCK == 1024 and sampler_module.GROUP == 64
    torch.manual_seed(7)
    logits = torch.randn(2500) * 2.5
    logits[[3, 1100, 2499]] += 6  # mass in every block, the tail included
    params = CASES[case]
    history = {"prompt": [3, 50, 50], "output": [1100, 1100, 7]} if case == "penalties" else {}
    expected = reference_probs(logits, params, **history)
    observed = empirical(logits[None], params, 4000, **history)
    assert set(observed.nonzero()[:, 0].tolist()) <= set(expected.nonzero()[:, 0].tolist())
    assert_same_distribution(observed, expected)


def assert_same_distribution(observed: torch.Tensor, expected: torch.Tensor, buckets: int = 8) -> None:
    """Tokens in buckets of about equal expected mass (most likely first): each bucket's observed
    share is within 5 sigma of its expected share (with 4000 draws, sigma <= 0.008)."""
    order = expected.argsort(descending=True)
    bucket = (expected[order].cumsum(0) - expected[order] + 1e-12).mul(buckets).floor().clamp(max=buckets - 1).long()
    want = torch.zeros(buckets, dtype=torch.float64).index_add_(0, bucket, expected[order])
    got = torch.zeros(buckets, dtype=torch.float64).index_add_(0, bucket, observed[order])
    sigma = (want * (1 - want) / 4000).sqrt()
    assert ((got - want).abs() <= 5 * sigma + 1e-3).all(), (got, want)


def test_top_p_on_a_flat_tail_beyond_the_first_threshold():
    # One likely token and 2999 tokens 5e-5 as likely: the 0.95 nucleus reaches into the tail,
    # below the first candidate threshold, so the sampler must redo the row with a lower one.
    logits = torch.full((3000,), math.log(5e-5))
    logits[0] = 0.0
    params = SamplingParams(top_p=0.95)
    expected = reference_probs(logits, params)
    observed = empirical(logits[None], params, 2000)
    assert set(observed.nonzero()[:, 0].tolist()) <= set(expected.nonzero()[:, 0].tolist())
    assert 0 < expected[0] < 1 and abs(observed[0] - expected[0]) < 0.05
    assert observed[1:].sum() > 0.05  # the tail is sampled


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_a_wide_nucleus_is_found_without_a_sort_and_follows_the_reference(monkeypatch, top_p):
    # A flat row: thousands of candidates, the threshold path (no sort of the row).
    calls = []
    wide = sampler_module.sample_wide_nucleus
    monkeypatch.setattr(sampler_module, "sample_wide_nucleus", lambda *a: calls.append(1) or wide(*a))
    torch.manual_seed(3)
    logits = torch.randn(3000) * 0.7
    logits[:3] += 3.0  # a few likely tokens over a long flat tail
    params = SamplingParams(top_p=top_p)
    expected = reference_probs(logits, params)
    observed = empirical(logits[None], params, 4000)
    assert calls
    assert set(observed.nonzero()[:, 0].tolist()) <= set(expected.nonzero()[:, 0].tolist())
    assert_same_distribution(observed, expected)


def test_top_p_only_and_top_k_rows_in_one_batch():
    torch.manual_seed(4)
    flat = torch.randn(3000) * 0.5
    peaked = torch.randn(3000) * 4.0
    logits = torch.stack([flat, peaked, flat, peaked])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(top_p=0.9, seed=1),
              SamplingParams(top_p=0.9)]
    tokens, _ = sample(logits, params, [0, 0, 0, 0])
    for row, p, token in zip(logits, params, tokens):
        assert reference_probs(row, p)[token] > 0
    assert sample(logits, params, [0, 0, 0, 0])[0][2] == tokens[2]  # the seeded wide row is reproducible


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.8), math.log(0.2)]])
    draws = [sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0][0] for s in range(400)]
    share = draws.count(0) / len(draws)
    assert 0.7 < share < 0.9


# ---- penalties -----------------------------------------------------------------------------------


def greedy_with(values, *, prompt=(), output=(), **penalties) -> int:
    params = SamplingParams(temperature=0, **penalties)
    return Sampler()(logits_row(values), [SamplingRow(params, len(output), prompt, output)])[0][0]


def test_penalties_push_greedy_away_from_repeated_tokens():
    logits = [2.0, 1.9, 0.0]
    assert greedy_with(logits, output=[0]) == 0
    assert greedy_with(logits, output=[0], presence_penalty=0.2) == 1
    assert greedy_with(logits, output=[0], presence_penalty=0.05) == 0
    assert greedy_with(logits, output=[0], frequency_penalty=0.05) == 0
    assert greedy_with(logits, output=[0, 0, 0], frequency_penalty=0.05) == 1  # per occurrence
    assert greedy_with(logits, output=[1], presence_penalty=-0.2) == 1  # negative: encourages
    # Repetition penalty counts the prompt too, and makes negative logits more negative.
    assert greedy_with(logits, prompt=[0], repetition_penalty=1.1) == 1
    assert greedy_with([-1.0, -1.05, -9.0], output=[0], repetition_penalty=1.1) == 1
    assert greedy_with(logits, prompt=[0], repetition_penalty=0.5) == 0


def test_frequency_penalty_lowers_the_probability_of_repeated_tokens():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=1.0)
    observed = empirical(logits, params, 4000, output=[2, 2])
    expected = math.exp(-2) / (3 + math.exp(-2))
    assert abs(observed[2] - expected) < 0.02
    assert observed[2] < observed[0]


def test_penalties_follow_a_requests_growing_output_across_steps():
    sampler = Sampler()
    output: list[int] = []
    params = SamplingParams(temperature=0, frequency_penalty=0.6)
    logits = logits_row([2.0, 1.5, 1.0])
    tokens = []
    for step in range(4):
        row = SamplingRow(params, len(output), [], output, request_id="r1")
        token = sampler(logits, [row])[0][0]
        tokens.append(token)
        output.append(token)
    # 0 (2.0); then 0 is at 1.4 < 1 (1.5); then 0 (1.4) > 2 (1.0) > 1 (0.9); then 0 is at 0.8.
    assert tokens == [0, 1, 0, 2]


# ---- seeds ---------------------------------------------------------------------------------------


def test_seed_is_reproducible_and_depends_on_position():
    logits = torch.zeros((1, 1000))
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, [params], [i])[0][0] for i in range(10)]
    again = [sample(logits, [params], [i])[0][0] for i in range(10)]
    assert first == again
    assert len(set(first)) > 1
    other = [sample(logits, [SamplingParams(temperature=1.0, seed=99)], [i])[0][0] for i in range(10)]
    assert other != first


@pytest.mark.parametrize("params", [
    SamplingParams(seed=11), SamplingParams(seed=12, top_k=40), SamplingParams(seed=13, top_p=0.9),
    SamplingParams(seed=14, min_p=0.02), SamplingParams(seed=-15, top_k=300, top_p=0.95, temperature=1.7),
])
def test_a_seeded_row_ignores_the_batch_around_it(params):
    torch.manual_seed(3)
    vocab = 5000
    mine = torch.randn(vocab) * 3
    row = SamplingRow(params, 17)
    alone = Sampler()(mine[None].clone(), [row])[0][0]
    others = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(top_k=3, seed=1),
              SamplingParams(min_p=0.3), SamplingParams(frequency_penalty=1.0)]
    for position in (0, 2, 5):
        batch = torch.randn(len(others) + 1, vocab) * 3
        batch[position] = mine
        rows = [SamplingRow(p, 3, [1, 2], [4, 4]) for p in others]
        rows.insert(position, row)
        torch.manual_seed(position)  # the unseeded rows' draw changes; the seeded row's must not
        assert Sampler()(batch, rows)[0][position] == alone


def test_seeded_uniforms_differ_across_nearby_seeds_and_positions():
    values = {seeded_uniform(seed, index) for seed in range(20) for index in range(20)}
    assert len(values) == 400 and all(0.0 <= v < 1.0 for v in values)


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_match_log_softmax_of_the_raw_logits():
    torch.manual_seed(5)
    logits = torch.randn(4, 300) * 3
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(logprobs=0, seed=1, top_k=5),
              SamplingParams(temperature=0), SamplingParams(logprobs=20, seed=2, repetition_penalty=1.5)]
    rows = [SamplingRow(p, 0, [1], [7]) for p in params]
    tokens, logprobs = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), -1)
    assert logprobs[2] is None
    for i, n in ((0, 2), (1, 0), (3, 20)):
        lp = logprobs[i]
        assert lp.token_id == tokens[i]
        assert abs(lp.logprob - float(reference[i, tokens[i]])) < 1e-4
        assert [t for t, _ in lp.top] == reference[i].argsort(descending=True)[:n].tolist()
        assert all(abs(v - float(reference[i, t])) < 1e-4 for t, v in lp.top)
    assert tokens[0] == logprobs[0].top[0][0]


# ---- robustness: no row can make the sampler raise, and a bad row never changes another ----------


def test_temperature_below_the_greedy_threshold_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 0.2], [30.0, 29.9, -40.0]])
    for temperature in (1e-40, 5e-324, 9e-6):
        params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2)]
        assert sample(logits, params, [0, 0])[0] == [1, 0]


def test_a_temperature_that_overflows_falls_back_to_the_argmax():
    logits = torch.tensor([[1e35, 3e35, -1e35], [0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=1e-5, top_p=0.9), SamplingParams(temperature=1e-5)]
    for _ in range(5):
        assert sample(logits, params, [0, 0])[0] == [1, 2]


def test_non_finite_rows_fall_back_to_the_argmax_of_their_finite_values():
    logits = torch.tensor([
        [0.0, NAN, 1.0, 0.5],    # NaN: argmax over the finite values
        [INF, 0.0, 2.0, 1.0],    # +inf is not a probability either
        [-INF, -INF, -INF, -INF],  # nothing finite: a fixed token, no exception
        [NAN, NAN, NAN, NAN],
        [0.0, 9.0, 0.0, 0.0],    # a healthy row next to them samples normally
    ])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.5, top_k=3, seed=3),
                   SamplingParams(seed=4, frequency_penalty=1, logprobs=2)):
        tokens, _ = Sampler()(logits, [SamplingRow(params, 1, [0], [1])] * 5)
        assert tokens[:2] == [2, 2]
        assert 0 <= tokens[2] < 4 and 0 <= tokens[3] < 4
        assert tokens[4] == 1


def test_a_bad_row_does_not_change_the_draws_of_the_others():
    torch.manual_seed(0)
    healthy = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9)]
    alone, _ = sample(healthy, params, [4, 4, 4])
    broken = torch.cat([healthy[:1], torch.full((1, 50), NAN), healthy[1:]])
    mixed, _ = sample(broken, params[:1] + [SamplingParams(temperature=1.0, seed=1)] + params[1:], [4] * 4)
    assert mixed[:1] + mixed[2:] == alone



@pytest.mark.skipif(inverse_cdf.top_p_kernel(torch.zeros(1, 2)) is None, reason="no C compiler here")
def test_the_top_p_kernel_picks_the_tokens_the_torch_path_picks(monkeypatch):
    # Flat rows of a 262k vocabulary, the case the kernel is for: the same nucleus and the same
    # column-order inverse CDF as the torch path, so the same uniform gives the same token.
    torch.manual_seed(5)
    n, vocab = 8, 262144
    e = torch.exp(torch.randn(n, vocab) * 1.5)
    e /= e.max(dim=-1, keepdim=True).values
    top_p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.95, 0.99, 0.3, 0.9])
    uniforms = torch.rand(n, dtype=torch.float64)
    from_kernel = inverse_cdf.sample_wide_nucleus(e.clone(), top_p, uniforms)
    monkeypatch.setattr(inverse_cdf, "top_p_kernel", lambda _e: None)
    from_torch = inverse_cdf.sample_wide_nucleus(e.clone(), top_p, uniforms)
    assert (from_kernel == from_torch).sum() >= n - 1  # fp64 sums in another order may move a boundary


@pytest.mark.parametrize("scale", [0.5, 4.0, 12.0])  # flat rows to a nucleus of a few tokens
def test_a_top_p_only_rows_token_does_not_depend_on_the_kernel_or_the_rows_width(monkeypatch, scale):
    # A draft model draws a sampled request's drafts with the uniform numbers its rows will draw
    # with, from its own logits on CPU (speculative/draft_sampling.py); a target on CUDA has no top-p
    # kernel.  Both must map a number to a token by one rule, whatever the nucleus's width.
    torch.manual_seed(6)
    logits = torch.randn(6, 3000) * scale
    params = [SamplingParams(top_p=p, temperature=t, seed=i)
              for i, (p, t) in enumerate([(0.8, 0.7), (0.9, 1.0), (0.5, 1.3), (0.95, 0.7), (0.3, 1.0), (0.99, 1.0)])]
    with_kernel = [sample(logits, params, [index] * 6)[0] for index in range(20)]
    for module in (inverse_cdf, sampler_module):  # wherever it is looked up
        monkeypatch.setattr(module, "top_p_kernel", lambda _e: None, raising=False)
    without = [sample(logits, params, [index] * 6)[0] for index in range(20)]
    agree = sum(a == b for row_a, row_b in zip(with_kernel, without) for a, b in zip(row_a, row_b))
    assert agree >= 6 * 20 - 2  # fp64 sums in another order may move a nucleus's boundary


def test_a_failing_code_path_fails_only_its_own_rows(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(3, 400)
    params = [SamplingParams(seed=1), SamplingParams(seed=2, top_p=0.9), SamplingParams(temperature=0)]
    expected, _ = sample(logits, params, [0, 0, 0])

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(Sampler, "_sample_filtered_rows", broken)
    sampler = Sampler()
    tokens, _ = sampler(logits, [SamplingRow(p) for p in params])
    assert tokens[0] == expected[0] and tokens[2] == expected[2]
    assert tokens[1] == int(logits[1].argmax()) and sampler.num_fallbacks == 1


def test_top_k_beyond_the_vocabulary_is_no_top_k():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    for seed in range(30):
        clamped = sample(logits, [SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=seed)], [0])[0]
        plain = sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [0])[0]
        assert clamped == plain


@pytest.mark.parametrize("fields, name", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": NAN}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": NAN}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2**40}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": INF}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -INF}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"seed": 2**63}, "seed"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_a_peer_cannot_send_out_of_range_sampling_params(fields, name):
    # Workers decode SamplingParams from peers' msgpack messages: the same ranges hold there.
    raw = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1, 2], "sampling_params": fields})
    with pytest.raises(ValueError, match=name):
        decode(raw, GenerateRequest)


def test_the_screened_head_takes_argmax_rows_and_plain_unseeded_samples_only():
    """``screen_inverse_temperatures``: greedy rows 0, plain unseeded rows 1 / T; any row that needs
    the logits (or a seeded draw's inverse CDF) sends the whole step to the logits."""
    greedy, plain = SamplingRow(SamplingParams(temperature=0.0)), SamplingRow(SamplingParams(temperature=0.5))
    assert screen_inverse_temperatures([greedy, plain, SamplingRow(SamplingParams(top_k=1))]) == [0.0, 2.0, 0.0]
    needs_logits = [SamplingParams(seed=3), SamplingParams(top_p=0.9), SamplingParams(top_k=5),
                    SamplingParams(min_p=0.1), SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5),
                    SamplingParams(temperature=0.0, repetition_penalty=1.2), SamplingParams(logit_bias=((3, 1.0),)),
                    SamplingParams(temperature=SCREEN_MIN_TEMPERATURE / 2)]
    for params in needs_logits:
        assert screen_inverse_temperatures([greedy, plain, SamplingRow(params)]) is None, params
    holding_stops = SamplingRow(SamplingParams(min_tokens=2), stop_token_ids=(1,))
    assert screen_inverse_temperatures([holding_stops]) is None


def test_logprobs_are_the_models_before_the_bias_and_the_min_tokens_ban():
    """As vLLM's by default: a biased token's logprob is the model's (the bias chose it), a token
    min_tokens holds back keeps its own; the sampled token is the processed logits' (the bias won)."""
    raw = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    model = torch.log_softmax(raw, dim=-1)[0]
    biased = SamplingRow(SamplingParams(temperature=0.0, logit_bias=((3, 100.0),), logprobs=1))
    held = SamplingRow(SamplingParams(temperature=0.0, min_tokens=2, logprobs=3), stop_token_ids=(0,))
    plain = SamplingRow(SamplingParams(temperature=0.0, logprobs=1))
    tokens, logprobs = Sampler()(raw.repeat(3, 1), [biased, held, plain])
    assert tokens == [3, 1, 0]
    assert logprobs[0].logprob == pytest.approx(model[3].item()) and logprobs[0].top[0][0] == 0
    assert logprobs[1].logprob == pytest.approx(model[1].item())
    assert dict(logprobs[1].top)[0] == pytest.approx(model[0].item())  # the held stop token: its own, not -inf
    assert logprobs[2].logprob == pytest.approx(model[0].item())
