"""Sampler: greedy, temperature, top-k, top-p, seeds, logprobs."""
import math

import torch

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
        tokens, _ = sample(logits, [SamplingParams(temperature=5.0, top_k=1, seed=seed)], [0])
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
