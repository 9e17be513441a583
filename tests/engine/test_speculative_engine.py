"""Speculative decoding in the engine: with drafts verified k + 1 at a time, greedy output equals
transformers' generate() and the engine without speculation, token for token, whether the drafts
are all right, right then wrong, or always wrong; across preemption, prefix-cache hits on blocks
that verification wrote, stop tokens and max_tokens inside accepted drafts; seeded sampling draws
the same tokens.  The n-gram proposer runs end to end; scripted proposers (drafts from the known
answer, spoiled at chosen places) make acceptance what each test needs."""
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.checkpoints import (
    VOCAB, GreedyReference, random_prompts, tiny_gemma3_config, tiny_llama_config, write_checkpoint,
)

pytestmark = pytest.mark.slow(seconds=12)  # a long file: scheduled by its length (tests/conftest.py)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAX_NEW = 24


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tmp_path_factory):
    config = tiny_llama_config() if request.param == "llama" else tiny_gemma3_config()
    directory = write_checkpoint(config, tmp_path_factory.mktemp(request.param))
    return directory, GreedyReference(directory, MAX_NEW)


def engine_for(directory, speculative="ngram", **overrides):
    fields = dict(model=str(directory), num_blocks=128, block_size=4, max_num_batched_tokens=512,
                  speculative=speculative, num_speculative_tokens=4,
                  speculative_cost_gate=False)  # what a test counts never depends on how the machine times steps
    fields.update(overrides)
    return Engine(EngineConfig(**fields), load_tokenizer=False)


class ScriptedProposer:
    """Drafts the known continuation of each prompt, with the draft at ``wrong_at`` (an index into
    each proposal) replaced by another token; ``wrong_at=0`` spoils every proposal."""

    def __init__(self, continuations: dict[tuple, list[int]], wrong_at: int | None = None):
        self.continuations = continuations
        self.wrong_at = wrong_at
        self.proposals = 0

    def propose(self, request, num_tokens, block_ids):
        token_ids = request.all_token_ids
        for prompt, answer in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                drafts = list(answer[len(token_ids) - len(prompt): len(token_ids) - len(prompt) + num_tokens])
                if self.wrong_at is not None and len(drafts) > self.wrong_at:
                    drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % VOCAB
                self.proposals += bool(drafts)
                return drafts
        return []

    def forget(self, request_id):
        pass


def scripted(engine, prompts, answers, wrong_at=None) -> ScriptedProposer:
    proposer = ScriptedProposer({tuple(p): a for p, a in zip(prompts, answers)}, wrong_at)
    engine.scheduler.speculation.proposer = proposer
    return proposer


def assert_clean(engine):
    engine.scheduler.kv_manager.check_integrity()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks  # nothing leaked


def test_ngram_greedy_equals_reference(checkpoint):
    directory, reference = checkpoint
    base = random_prompts([6, 19, 33], seed=1)
    prompts = base + [p + p for p in base]  # repeated text: the lookup finds the prompt's own span
    engine = engine_for(directory, ngram_min=1)
    results = engine.generate(prompts, {**GREEDY, "max_tokens": MAX_NEW})
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(prompt)
    stats = engine.stats()
    assert stats["spec_verifications_total"] > 0 and stats["spec_draft_tokens_total"] > 0
    assert_clean(engine)


def test_all_drafts_accepted_takes_a_fifth_of_the_steps(checkpoint):
    directory, reference = checkpoint
    prompt = random_prompts([13], seed=2)[0]
    engine = engine_for(directory)
    scripted(engine, [prompt], [reference(prompt, 21)])
    result = engine.generate([prompt], {**GREEDY, "max_tokens": 21})[0]
    assert result.token_ids == reference(prompt, 21)
    assert engine.num_steps == 1 + 20 // 5  # the prompt's step, then 5 tokens per verification
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_tokens_per_verification"] == 5.0
    assert_clean(engine)


@pytest.mark.parametrize("wrong_at", [0, 1, 3])
def test_rejected_drafts_change_nothing(checkpoint, wrong_at):
    directory, reference = checkpoint
    prompts = random_prompts([7, 21, 30], seed=3)
    engine = engine_for(directory, speculative_min_accepted=0.0)  # never back off: verify every step
    scripted(engine, prompts, [reference(p) for p in prompts], wrong_at)
    results = engine.generate(prompts, {**GREEDY, "max_tokens": MAX_NEW})
    assert [r.token_ids for r in results] == [reference(p) for p in prompts]
    stats = engine.stats()
    assert stats["spec_accepted_tokens_total"] == wrong_at * stats["spec_verifications_total"] or wrong_at == 3
    assert_clean(engine)


def test_blocks_written_by_verification_serve_prefix_hits(checkpoint):
    """A block holds KV of rejected drafts until later tokens overwrite it; only then may the
    prefix cache keep it.  A follow-up prompt that reuses the first answer's blocks must decode
    exactly as from scratch."""
    directory, reference = checkpoint
    prompt = random_prompts([9], seed=4)[0]
    engine = engine_for(directory, speculative_min_accepted=0.0)
    answer = reference(prompt, 40)
    scripted(engine, [prompt], [answer], wrong_at=2)
    assert engine.generate([prompt], {**GREEDY, "max_tokens": 40})[0].token_ids == answer
    follow_up = prompt + answer[:33]
    result = engine.generate([follow_up], {**GREEDY, "max_tokens": 12})[0]
    assert result.num_cached_tokens == 40  # ten blocks, most written by verification steps
    assert result.token_ids == reference(follow_up, 12)
    assert_clean(engine)


def test_preemption_with_speculation(checkpoint):
    directory, reference = checkpoint
    prompts = random_prompts([20, 22, 18, 21], seed=5)
    answers = [reference(p, 16) for p in prompts]
    # 16 blocks of 4 tokens: each request fits alone (drafts included), all four together do not.
    engine = engine_for(directory, num_blocks=16, max_num_batched_tokens=64, watermark=0.0,
                        speculative_min_accepted=0.0)
    scripted(engine, prompts, answers, wrong_at=2)
    results = engine.generate(prompts, {**GREEDY, "max_tokens": 16})
    assert engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == answers
    assert_clean(engine)


def test_stop_token_and_max_tokens_inside_accepted_drafts(checkpoint):
    directory, reference = checkpoint
    prompt = random_prompts([11], seed=6)[0]
    answer = reference(prompt, 30)
    stop = answer[6]
    engine = engine_for(directory)
    scripted(engine, [prompt], [answer])
    result = engine.generate([prompt], {**GREEDY, "max_tokens": 30, "stop_token_ids": [stop]})[0]
    assert result.token_ids == answer[: answer.index(stop) + 1] and result.finish_reason == "stop"
    result = engine.generate([prompt], {**GREEDY, "max_tokens": 7})[0]
    assert result.token_ids == answer[:7] and result.finish_reason == "length"
    assert_clean(engine)


def test_seeded_sampling_draws_the_same_tokens(checkpoint):
    directory, _ = checkpoint
    prompts = random_prompts([8, 15, 26], seed=7)
    params = [{"temperature": 0.9, "top_p": 0.95, "seed": 11 + i, "ignore_eos": True, "max_tokens": 20, "logprobs": 2}
              for i in range(len(prompts))]
    plain = engine_for(directory, speculative="none")
    expected = [plain.generate([p], q)[0] for p, q in zip(prompts, params)]
    engine = engine_for(directory, speculative_min_accepted=0.0)
    proposer = scripted(engine, prompts, [r.token_ids for r in expected], wrong_at=2)
    got = [engine.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for a, b in zip(got, expected):  # one logprob entry per token, the distribution's at that position
        assert len(a.logprobs) == len(b.logprobs) == 20
        assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
        assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a.logprobs, b.logprobs))
    assert proposer.proposals > 0 and engine.stats()["spec_accepted_tokens_total"] > 0


def test_wrong_drafts_back_off(checkpoint):
    directory, reference = checkpoint
    prompt = random_prompts([10], seed=8)[0]
    engine = engine_for(directory)
    scripted(engine, [prompt], [reference(prompt, 60)], wrong_at=0)
    assert engine.generate([prompt], {**GREEDY, "max_tokens": 60})[0].token_ids == reference(prompt, 60)
    stats = engine.stats()
    assert stats["spec_backoffs_total"] >= 1
    assert stats["spec_verifications_total"] <= 20  # most steps decoded plainly
