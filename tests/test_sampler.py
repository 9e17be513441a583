"""Sampler: greedy, temperature, top-k, top-p, seeds, logprobs."""
import math

import msgspec
import pytest
import torch

from common.cluster.messages import GenerateRequest, decode
from common.engine.sampler import sample
from common.engine.sampling_params import SamplingParams


def logits_row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    tokens, _ = sample(logits, [SamplingParams(temperature=0)] * 2, [0, 0])
    assert tokens == [1, 0]


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = logits_row([0.0, 2.0, 1.9, 1.8])
    for seed in range(20):
        tokens, _ = sample(logits, [SamplingParams(temperature=2.0, top_k=1, seed=seed)], [0])
        assert tokens == [1]


def test_top_p_keeps_only_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    seen = set()
    for seed in range(200):
        tokens, _ = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=seed)], [0])
        seen.add(tokens[0])
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut


def test_seed_is_reproducible_and_depends_on_position():
    logits = torch.zeros((1, 1000))
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, [params], [i])[0][0] for i in range(10)]
    again = [sample(logits, [params], [i])[0][0] for i in range(10)]
    assert first == again
    assert len(set(first)) > 1
    other = [sample(logits, [SamplingParams(temperature=1.0, seed=99)], [i])[0][0] for i in range(10)]
    assert other != first


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.8), math.log(0.2)]])
    draws = [sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0][0] for s in range(400)]
    share = draws.count(0) / len(draws)
    assert 0.7 < share < 0.9


def test_logprobs_of_sampled_and_top_tokens():
    logits = logits_row([2.0, 1.0, 0.0])
    tokens, logprobs = sample(logits, [SamplingParams(temperature=0, logprobs=2)], [0])
    expected = torch.log_softmax(logits[0], -1)
    lp = logprobs[0]
    assert lp.token_id == 0 and abs(lp.logprob - float(expected[0])) < 1e-6
    assert [t for t, _ in lp.top] == [0, 1]
    assert abs(lp.top[1][1] - float(expected[1])) < 1e-6
    _, none = sample(logits, [SamplingParams(temperature=0)], [0])
    assert none == [None]


# ---- robustness: no row can make the sampler raise, and a bad row never changes another ----------

NAN, INF = float("nan"), float("inf")


def test_temperature_below_the_greedy_threshold_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 0.2], [30.0, 29.9, -40.0]])
    for temperature in (1e-40, 5e-324, 9e-6):
        params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2)]
        assert sample(logits, params, [0, 0])[0] == [1, 0]


def test_non_finite_rows_fall_back_to_the_argmax_of_their_finite_values():
    logits = torch.tensor([
        [0.0, NAN, 1.0, 0.5],    # NaN: argmax over the finite values
        [INF, 0.0, 2.0, 1.0],    # +inf is not a probability either
        [-INF, -INF, -INF, -INF],  # nothing finite: a fixed token, no exception
        [NAN, NAN, NAN, NAN],
        [0.0, 9.0, 0.0, 0.0],    # a healthy row next to them samples normally
    ])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.5, top_k=3, seed=3)):
        tokens, _ = sample(logits, [params] * 5, [0] * 5)
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


def test_top_k_beyond_the_vocabulary_is_no_top_k():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    for seed in range(30):
        clamped = sample(logits, [SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=seed)], [0])[0]
        plain = sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [0])[0]
        assert clamped == plain


@pytest.mark.parametrize("fields, name", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": NAN}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": NAN}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2**40}, "top_k"),
    ({"seed": 2**63}, "seed"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_a_peer_cannot_send_out_of_range_sampling_params(fields, name):
    # Workers decode SamplingParams from peers' msgpack messages: the same ranges hold there.
    raw = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1, 2], "sampling_params": fields})
    with pytest.raises(ValueError, match=name):
        decode(raw, GenerateRequest)
