"""Prompt logprobs (``SamplingParams.prompt_logprobs``, common/engine/prompt_logprobs.py): entry i
scores prompt token i + 1 as transformers' forward over the prompt does (log-softmax of its logits,
fp32, tiny random checkpoints), whole prompts or chunked, beside other requests, with the prompt's
blocks in the prefix cache (not read: every position is computed), and across preemption."""
from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import MAX_PROMPT_LOGPROB_VALUES, SamplingParams
from tests.support.checkpoints import random_prompts, tiny_gemma3_config, tiny_llama_config, write_checkpoint

SCORED = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 2, "prompt_logprobs": 3}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tmp_path_factory):
    config = tiny_llama_config() if request.param == "llama" else tiny_gemma3_config()
    return write_checkpoint(config, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The log-softmax of transformers' logits over a whole prompt: [positions, vocabulary]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return run


def engine_for(directory, **overrides):
    fields = dict(model=str(directory), num_blocks=128, block_size=4, max_num_batched_tokens=512)
    fields.update(overrides)
    return Engine(EngineConfig(**fields), load_tokenizer=False)


def assert_scored(entries, prompt, expected: torch.Tensor, top: int = 3) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for i, entry in enumerate(entries):
        assert len(entry.top) == top
        ids = [t for t, _ in entry.top]
        assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), expected[i, ids], atol=1e-4)
        assert expected[i, ids].tolist() == sorted(expected[i, ids].tolist(), reverse=True)
        assert not ids or ids[0] == int(expected[i].argmax())


def test_whole_and_chunked_prompts_score_as_transformers(checkpoint, reference):
    prompts = random_prompts([1, 2, 13, 40])
    whole = engine_for(checkpoint).generate(prompts, SCORED)
    # Chunks of 8 tokens a step, the prompts beside each other's decodes.
    chunked = engine_for(checkpoint, max_num_batched_tokens=8).generate(prompts, SCORED)
    for prompt, a, b in zip(prompts, whole, chunked):
        expected = reference(prompt)
        assert_scored(a.prompt_logprobs, prompt, expected)
        assert_scored(b.prompt_logprobs, prompt, expected)
        assert a.token_ids == b.token_ids
    plain = engine_for(checkpoint).generate(prompts, {**SCORED, "prompt_logprobs": None})
    assert all(r.prompt_logprobs is None for r in plain)
    assert [r.token_ids for r in plain] == [r.token_ids for r in whole]


def test_a_cached_prefix_is_computed_again_and_alternatives_are_cut_per_request(checkpoint, reference):
    engine = engine_for(checkpoint)
    prompt = random_prompts([29], seed=4)[0]
    engine.generate([prompt], {**SCORED, "prompt_logprobs": None})  # its blocks are in the prefix cache now
    again = engine.generate([prompt], {**SCORED, "prompt_logprobs": None})[0]
    assert again.num_cached_tokens > 0
    scored = engine.generate([prompt], {**SCORED, "prompt_logprobs": 0})[0]
    assert scored.num_cached_tokens == 0
    assert_scored(scored.prompt_logprobs, prompt, reference(prompt), top=0)
    # Two requests of one step, 1 and 5 alternatives: each gets its own.
    pair = engine.generate([prompt, prompt[:11]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5))
    assert [len(e.top) for e in pair[0].prompt_logprobs] == [5] * 28
    one, five = engine.generate([prompt[:11]], {**SCORED, "prompt_logprobs": 1})[0], pair[1]
    assert [e.top[:1] for e in five.prompt_logprobs] == [e.top for e in one.prompt_logprobs]
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_preempted_request_keeps_its_scores(checkpoint, reference):
    """14 blocks of 4 tokens, prompts in chunks of 8: the requests preempt each other and compute
    their prompts again; each prompt token is scored once, as transformers scores it."""
    engine = engine_for(checkpoint, num_blocks=14, max_num_batched_tokens=8, watermark=0.0)
    prompts = random_prompts([20, 22, 18, 21], seed=3)
    results = engine.generate(prompts, {**SCORED, "max_tokens": 16})
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert_scored(result.prompt_logprobs, prompt, reference(prompt))


def test_scores_are_handed_out_once_and_a_resumed_stream_is_not_scored(checkpoint):
    """The first output takes the entries (the request keeps only their count: a preemption after
    it scores nothing again); a moved stream's prompt (scored where it began) reads the prefix
    cache and is not scored."""
    engine = engine_for(checkpoint)
    prompt = random_prompts([26], seed=9)[0]
    request_id = engine.add_request(prompt, SCORED)
    first = []
    while not first:
        first = [o for o in engine.step() if o.new_token_ids]
    request = engine.scheduler.requests[request_id]
    assert len(first[0].prompt_logprobs) == 25 and request.prompt_logprobs == []
    assert request.num_scored_tokens == 25 and not request.scores_prompt
    while engine.has_unfinished():
        assert all(o.prompt_logprobs is None for o in engine.step())
    moved = engine.make_request(prompt, {**SCORED, "max_tokens": 4}, resume_token_ids=[7, 8])
    assert not moved.scores_prompt
    engine.scheduler.add_request(moved)
    while engine.has_unfinished():
        engine.step()
        assert not engine.runner.prompt_logprobs
    assert moved.num_cached_tokens > 0


def test_a_prompt_scored_beyond_the_bound_is_refused(checkpoint):
    engine = engine_for(checkpoint)
    tokens = MAX_PROMPT_LOGPROB_VALUES // 4 + 1
    with pytest.raises(ValueError, match="prompt logprobs for"):
        engine.make_request([5] * tokens, SamplingParams(prompt_logprobs=3))
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
