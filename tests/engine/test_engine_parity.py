"""Greedy outputs equal transformers' generate() token for token, in fp32, on tiny random
checkpoints saved to disk: whole prompts, chunked prompts beside decodes, preemption, prefix hits."""
import json

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.checkpoints import (
    GreedyReference, random_prompts, tiny_gemma3_config, tiny_llama_config, write_checkpoint,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAX_NEW = 10


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tmp_path_factory):
    config = tiny_llama_config() if request.param == "llama" else tiny_gemma3_config()
    directory = write_checkpoint(config, tmp_path_factory.mktemp(request.param))
    return directory, GreedyReference(directory, MAX_NEW)


def engine_for(directory, **overrides):
    fields = dict(model=str(directory), num_blocks=128, block_size=4, max_num_batched_tokens=512)
    fields.update(overrides)
    return Engine(EngineConfig(**fields), load_tokenizer=False)


def test_whole_prompts(checkpoint):
    directory, reference = checkpoint
    engine = engine_for(directory)
    prompts = random_prompts([3, 17, 30, 41])
    results = engine.generate(prompts, {**GREEDY, "max_tokens": MAX_NEW})
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(prompt)
        assert result.finish_reason == "length"
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    head = engine.model.greedy_head  # None only where the CPU has neither AVX-512 nor AVX2
    assert head is None or head.exact_rows > 0, "greedy steps took the logits, not the screened head"


def test_steps_that_need_the_logits_compute_them(checkpoint):
    """Logprobs, or one row with a penalty beside greedy ones: the step samples from the logits
    (the screened head gives argmaxes only), and the greedy tokens are the same."""
    directory, reference = checkpoint
    engine = engine_for(directory)
    prompts = random_prompts([5, 12], seed=3)
    with_logprobs = engine.generate(prompts, {**GREEDY, "max_tokens": MAX_NEW, "logprobs": 2})
    assert [r.token_ids for r in with_logprobs] == [reference(p) for p in prompts]
    assert all(len(r.logprobs) == MAX_NEW for r in with_logprobs)
    assert engine.model.greedy_head is None or engine.model.greedy_head.exact_rows == 0


def test_steps_with_more_rows_than_the_screen_gains_on_compute_the_logits(checkpoint):
    """A head's ``max_rows`` (32 on AVX2, where larger batches gain nothing): steps past it take the
    logits, and the tokens are the same."""
    directory, reference = checkpoint
    engine = engine_for(directory)
    head = engine.model.greedy_head
    if head is None:
        pytest.skip("no screened head on this CPU")
    head.max_rows = 2
    prompts = random_prompts([4, 6, 9], seed=5)  # every step samples three rows
    results = engine.generate(prompts, {**GREEDY, "max_tokens": MAX_NEW})
    assert [r.token_ids for r in results] == [reference(p) for p in prompts]
    assert head.exact_rows == 0


def test_prompts_chunked_across_steps_while_others_decode(checkpoint):
    directory, reference = checkpoint
    engine = engine_for(directory, max_num_batched_tokens=6)
    early, late = random_prompts([5, 9], seed=1), random_prompts([37, 29], seed=2)
    outputs = {}
    ids = [engine.add_request(p, {**GREEDY, "max_tokens": MAX_NEW}) for p in early]
    mixed_steps = 0
    for _ in range(3):  # the early requests are decoding by now
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    ids += [engine.add_request(p, {**GREEDY, "max_tokens": MAX_NEW}) for p in late]
    while engine.has_unfinished():
        before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        chunked = [r for r in engine.scheduler.running if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        if chunked and any(before.get(r.request_id) for r in engine.scheduler.running):
            mixed_steps += 1
    assert mixed_steps >= 5  # long prompts really were split while other requests decoded
    for rid, prompt in zip(ids, early + late):
        assert outputs[rid] == reference(prompt)


def test_preemption_and_recompute(checkpoint):
    directory, reference = checkpoint
    # 14 blocks of 4 tokens: each request fits alone, all four together do not.
    engine = engine_for(directory, num_blocks=14, max_num_batched_tokens=64, watermark=0.0)
    prompts = random_prompts([20, 22, 18, 21], seed=3)
    results = engine.generate(prompts, {**GREEDY, "max_tokens": 16})
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(prompt, 16)
    engine.block_pool.check_integrity()


def test_prefix_cache_hit_computes_only_the_suffix(checkpoint):
    directory, reference = checkpoint
    engine = engine_for(directory)
    shared = random_prompts([40], seed=4)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    assert engine.generate([first], {**GREEDY, "max_tokens": MAX_NEW})[0].token_ids == reference(first)

    computed = []
    original = engine.runner.execute

    def counting_execute(out):
        computed.append(sum(len(s.token_ids) for s in out.scheduled))
        return original(out)

    engine.runner.execute = counting_execute
    result = engine.generate([second], {**GREEDY, "max_tokens": MAX_NEW})[0]
    assert result.num_cached_tokens == 40  # ten full blocks of the shared prefix
    assert computed[0] == len(second) - 40  # the first step computes only the suffix
    assert result.token_ids == reference(second)


def test_sliding_window_is_in_effect(tmp_path):
    """Guards the Gemma parity tests: with the window widened, outputs must change."""
    narrow = write_checkpoint(tiny_gemma3_config(), tmp_path / "narrow")
    wide = write_checkpoint(tiny_gemma3_config(), tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    config["sliding_window"] = 512
    (wide / "config.json").write_text(json.dumps(config))
    prompts = random_prompts([30, 40], seed=5)
    a = [r.token_ids for r in engine_for(narrow).generate(prompts, {**GREEDY, "max_tokens": MAX_NEW})]
    b = [r.token_ids for r in engine_for(wide).generate(prompts, {**GREEDY, "max_tokens": MAX_NEW})]
    assert a != b
