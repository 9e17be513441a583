"""Sampling through the engine: penalties equal transformers' (fp32, greedy), a seeded request's
tokens do not depend on what else runs, how its prompt is chunked, or preemption, and plain unseeded
sampling takes the screened head (seeded requests keep the logits)."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.checkpoints import VOCAB, tiny_llama_config, write_checkpoint

MAX_NEW = 12


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_checkpoint(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


def engine_for(directory, **overrides):
    fields = dict(model=str(directory), num_blocks=128, block_size=4, max_num_batched_tokens=512)
    fields.update(overrides)
    return Engine(EngineConfig(**fields), load_tokenizer=False)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def transformers_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def transformers_greedy(model, prompt, *, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0):
    """transformers' generate() with its repetition penalty, plus OpenAI's frequency/presence
    penalties as a logits processor over the generated tokens (vLLM's order: repetition first)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for row, ids in enumerate(input_ids[:, len(prompt):]):
                counts = torch.bincount(ids, minlength=scores.shape[-1]).to(scores.dtype)
                scores[row] -= frequency_penalty * counts + presence_penalty * (counts > 0).to(scores.dtype)
            return scores

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             repetition_penalty=repetition_penalty, logits_processor=LogitsProcessorList([OpenAIPenalties()]),
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.0, "frequency_penalty": -0.5, "repetition_penalty": 1.3},
])
def test_greedy_penalties_equal_transformers(directory, transformers_model, penalties):
    engine = engine_for(directory, max_num_batched_tokens=8)  # prompts chunked, decodes beside them
    batch = prompts([5, 19, 30], seed=1)
    results = engine.generate(batch, {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **penalties})
    plain = engine.generate(batch, {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    assert [r.token_ids for r in results] != [r.token_ids for r in plain]  # the penalties did something
    for prompt, result in zip(batch, results):
        assert result.token_ids == transformers_greedy(transformers_model, prompt, **penalties)


SEEDED = [
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.9, "top_k": 20, "seed": 4},
    {"temperature": 1.2, "top_p": 0.8, "seed": 5},
    {"temperature": 1.0, "min_p": 0.1, "frequency_penalty": 0.5, "seed": 6},
]


def run_all(engine, requests):
    """Add every (prompt, params) at once, step to the end; token ids per request."""
    ids = [engine.add_request(p, {"max_tokens": MAX_NEW, "ignore_eos": True, **params}) for p, params in requests]
    out = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[rid] for rid in ids]


def test_seeded_requests_ignore_batch_chunking_and_preemption(directory):
    mine = prompts([23, 9, 31, 14], seed=2)
    alone = [run_all(engine_for(directory), [(p, params)])[0] for p, params in zip(mine, SEEDED)]
    assert len({tuple(t) for t in alone}) == len(alone)

    # Together, in another order, beside unseeded and greedy requests, prompts chunked 6 tokens a
    # step, and a pool so small that requests get preempted and recomputed.
    noise = [(p, {"temperature": 1.0}) for p in prompts([17, 28], seed=3)] + [(prompts([12], seed=4)[0], {"temperature": 0})]
    engine = engine_for(directory, num_blocks=24, max_num_batched_tokens=6)
    mixed = list(zip(mine, SEEDED))[::-1] + noise
    together = run_all(engine, mixed)[: len(mine)][::-1]
    assert engine.scheduler.num_preemptions > 0
    assert together == alone


def test_plain_unseeded_sampling_takes_the_screened_head_and_seeded_requests_keep_the_logits(directory):
    engine = engine_for(directory)
    head = engine.model.greedy_head
    if head is None:
        pytest.skip("no screened head on this CPU (AVX-512 or AVX2 with FMA)")
    batch = prompts([5, 9, 14], seed=4)
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": MAX_NEW, "ignore_eos": True}
    first = [r.token_ids for r in engine.generate(batch, seeded)]
    assert head.sampled_rows == 0
    results = engine.generate(batch, {"temperature": 0.8, "max_tokens": MAX_NEW, "ignore_eos": True})
    assert head.sampled_rows > 0
    assert all(len(r.token_ids) == MAX_NEW and all(0 <= t < VOCAB for t in r.token_ids) for r in results)
    assert [r.token_ids for r in engine.generate(batch, seeded)] == first
    engine.block_pool.check_integrity()


def test_a_row_the_screen_leaves_undecided_is_sampled_from_its_logits_alone(directory):
    """The kernel marks a sampled row no trial decided with -1 (test_greedy_head makes one); the
    runner samples that row alone from its logits and keeps the screen's tokens for the rest."""
    engine = engine_for(directory)
    head = engine.model.greedy_head
    if head is None:
        pytest.skip("no screened head on this CPU (AVX-512 or AVX2 with FMA)")
    sample, undecided, logits_rows = head.sample, [], []

    def first_row_undecided(x, inverse_temperatures, uniforms):
        tokens = sample(x, inverse_temperatures, uniforms)
        if tokens is not None:
            tokens[0] = -1
            undecided.append(len(tokens))
        return tokens

    logits = engine.model.logits

    def counted_logits(hidden):
        logits_rows.append(len(hidden))
        return logits(hidden)

    head.sample, engine.model.logits = first_row_undecided, counted_logits
    batch = prompts([5, 9, 14], seed=5)
    results = engine.generate(batch, {"temperature": 1.0, "max_tokens": MAX_NEW, "ignore_eos": True})
    assert all(len(r.token_ids) == MAX_NEW and all(0 <= t < VOCAB for t in r.token_ids) for r in results)
    assert undecided and max(undecided) == 3  # whole decode steps went through the screen
    assert logits_rows == [1] * len(undecided)  # and their undecided row alone through the logits
    engine.block_pool.check_integrity()
