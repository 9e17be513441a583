"""``speculative.draft_sampling``: a draft's token for a uniform number is the token the target's
sampler draws with that number from the same logits, under every rule (plain, top-p alone in column
order, top-k / min-p by probability, temperatures); over a part of the vocabulary, the token it
draws when the rest have no probability (and without the request's logit bias, which names token ids);
the rows after the drafts sample with the drafts' numbers."""
from __future__ import annotations

import msgspec
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.engine.inverse_cdf import seeded_uniform, uniforms_for
from common.engine.sampler import Sampler, sample, screen_inverse_temperatures
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler_output import ScheduledRequest
from common.engine.speculative.draft_sampling import draft_uniforms, sample_drafts
from common.engine.speculative.verify import sampling_rows

VOCAB = 3000  # not a multiple of the sampler's 1024-column blocks

rules = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.5, 1.0, 1.3]),
    "top_p": st.sampled_from([1.0, 0.9, 0.4]),
    "top_k": st.sampled_from([0, 1, 7, 200]),
    "min_p": st.sampled_from([0.0, 0.03]),
})


def logits_of(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


@settings(max_examples=80, deadline=None)
@given(rule=rules, seed=st.integers(0, 2**31 - 1), index=st.integers(0, 500), scale=st.sampled_from([1.0, 4.0]))
def test_the_draft_draws_what_the_sampler_draws_with_the_same_number(rule, seed, index, scale):
    logits = logits_of(seed, scale)
    params = SamplingParams(**rule, seed=seed)
    (expected,), _ = sample(logits[None].clone(), [params], [index])
    uniforms = draft_uniforms(params, index, 1)
    if params.top_k == 1:
        assert uniforms is None  # the sampler's argmax: greedy drafts
        return
    assert uniforms == [seeded_uniform(seed, index)]
    assert sample_drafts(Sampler(), logits[None].clone(), [params], uniforms, VOCAB) == [expected]


@settings(max_examples=40, deadline=None)
@given(rule=rules, seed=st.integers(0, 2**31 - 1), kept=st.integers(20, VOCAB - 1))
@example(rule={"temperature": 0.5, "top_p": 1.0, "top_k": 200, "min_p": 0.0}, seed=1, kept=20)  # k past the part
def test_over_a_part_of_the_tokens_it_draws_as_if_the_rest_had_no_probability(rule, seed, kept):
    logits = logits_of(seed, 3.0)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:kept].sort().values
    params = SamplingParams(**{**rule, "top_k": 0 if rule["top_k"] == 1 else rule["top_k"]}, seed=seed,
                            logit_bias=((int(ids[0]), 5.0),), logprobs=2)  # ids: left out of a draft
    full = torch.full((VOCAB,), float("-inf"))
    full[ids] = logits[ids]
    plain = msgspec.structs.replace(params, logit_bias=(), logprobs=None)
    (expected,), _ = sample(full[None], [plain], [3])
    (column,) = sample_drafts(Sampler(), logits[ids][None].clone(), [params], [seeded_uniform(seed, 3)], VOCAB)
    assert int(ids[column]) == expected


def test_the_rows_after_the_drafts_sample_with_the_drafts_numbers():
    params = SamplingParams(temperature=0.9)
    item = ScheduledRequest("r", [5, 8, 9], 10, [0], True, params, num_output_tokens=4, draft_token_ids=[8, 9],
                            draft_uniforms=[0.25, 0.75])
    rows = sampling_rows([item])
    assert [row.uniform for row in rows] == [0.25, 0.75, None]  # the last row draws its own
    assert uniforms_for(rows, torch.device("cpu"))[:2].tolist() == [0.25, 0.75]
    assert screen_inverse_temperatures(rows) is None  # the screened head would not use them
    assert screen_inverse_temperatures(rows[2:]) == [1 / 0.9]
    assert draft_uniforms(SamplingParams(temperature=0.0), 0, 3) is None
    fresh = draft_uniforms(params, 0, 3)
    assert len(fresh) == 3 and all(0.0 <= u < 1.0 for u in fresh) and len(set(fresh)) == 3
