"""Speculative decoding with a draft model (``speculative.draft_model``): greedy drafts of a smaller
model, its KV at the target's block ids, computed on the decode side from the prompt on.  Greedy
output equals transformers' generate() whatever the draft (the target itself: every draft accepted;
another model: most rejected), across preemption (the draft's KV is recomputed with the blocks);
seeded sampling draws the same tokens; a sampled request's drafts are samples its rows keep (the
target as its draft: nearly all); a draft of another vocabulary is refused."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.checkpoints import VOCAB, GreedyReference, tiny_llama_config, write_checkpoint

GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAX_NEW = 20


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = write_checkpoint(tiny_llama_config(), tmp_path_factory.mktemp("target"))
    return directory, GreedyReference(directory, MAX_NEW)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A smaller model of the same vocabulary, other weights: its guesses are mostly wrong."""
    return write_checkpoint(tiny_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
                            tmp_path_factory.mktemp("draft"), seed=1)


def engine_for(directory, draft, **overrides):
    fields = dict(model=str(directory), num_blocks=128, block_size=4, max_num_batched_tokens=512,
                  speculative="draft", draft_model=str(draft), num_speculative_tokens=4, speculative_min_accepted=0.0,
                  speculative_cost_gate=False)
    fields.update(overrides)
    engine = Engine(EngineConfig(**fields), load_tokenizer=False)
    return engine


def prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_the_target_as_its_own_draft_is_always_right(target):
    directory, reference = target
    engine = engine_for(directory, directory)
    batch = prompts([9, 23, 14], seed=1)
    results = engine.generate(batch, {**GREEDY, "max_tokens": MAX_NEW + 1})
    assert [r.token_ids for r in results] == [reference(p, MAX_NEW + 1) for p in batch]
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert engine.num_steps == 1 + MAX_NEW // 5  # the prompts' step, then 5 tokens per verification
    # the first proposal fed the draft the prompts: timed as its catch-up, and not judged by the gate
    proposer = engine.scheduler.speculation.proposer
    assert proposer.seconds_per_fed_token is not None and proposer.seconds_per_fed_token > 0
    assert not proposer.catching_up  # the last proposal fed each request its verification's tokens
    engine.scheduler.kv_manager.check_integrity()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_steps_requests_are_drafted_for_together(target, monkeypatch):
    """One draft forward per draft position for the whole step, not one per request and position."""
    directory, reference = target
    engine = engine_for(directory, directory)
    proposer = engine.scheduler.speculation.proposer
    forwards = []
    model_forward = proposer.model.forward
    monkeypatch.setattr(proposer.model, "forward", lambda tokens, *rest: forwards.append(len(tokens))
                        or model_forward(tokens, *rest))
    batch = prompts([9, 23, 14, 5], seed=2)
    results = engine.generate(batch, {**GREEDY, "max_tokens": MAX_NEW + 1})
    assert [r.token_ids for r in results] == [reference(p, MAX_NEW + 1) for p in batch]
    verifications = engine.num_steps - 1
    assert len(forwards) == 4 * verifications  # num_speculative_tokens each, over the 4 requests at once
    assert forwards[:4] == [9 + 23 + 14 + 5 + 4, 4, 4, 4]  # the prompts and first tokens, then a draft each


# Acceptance each draft reaches at least: int4's groups of 32 of this tiny random model's 64 inputs
# (flat logits) agree far less than int8 does; a model of other weights is almost never right.
@pytest.mark.parametrize("scheme,acceptance", [("int8", 0.5), ("int4", 0.1)])
def test_the_target_quantized_drafts_for_itself(target, tmp_path, monkeypatch, scheme, acceptance):
    # The served model's own weights, quantized, as the draft: most drafts are accepted and the
    # answers are the full-precision model's, whatever the draft's rounding.
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))  # its prepacked weights go there
    directory, reference = target
    engine = engine_for(directory, directory, draft_quantization=scheme)
    assert engine.scheduler.speculation.proposer.model.quantized_weights()  # the draft computes quantized
    batch = prompts([9, 23, 14], seed=3)
    results = engine.generate(batch, {**GREEDY, "max_tokens": MAX_NEW + 1})
    assert [r.token_ids for r in results] == [reference(p, MAX_NEW + 1) for p in batch]
    assert engine.stats()["spec_acceptance_rate"] > acceptance
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_another_draft_changes_nothing_but_the_speed(target, other_draft):
    directory, reference = target
    engine = engine_for(directory, other_draft)
    batch = prompts([5, 17, 30], seed=2)
    results = engine.generate(batch, {**GREEDY, "max_tokens": MAX_NEW})
    assert [r.token_ids for r in results] == [reference(p) for p in batch]
    assert engine.stats()["spec_verifications_total"] > 0


def test_preempted_requests_recompute_the_drafts_kv(target, other_draft):
    directory, reference = target
    batch = prompts([20, 22, 18, 21], seed=3)
    for draft in (directory, other_draft):
        engine = engine_for(directory, draft, num_blocks=16, max_num_batched_tokens=64, watermark=0.0)
        results = engine.generate(batch, {**GREEDY, "max_tokens": 16})
        assert engine.scheduler.num_preemptions > 0
        assert [r.token_ids for r in results] == [reference(p, 16) for p in batch]
        engine.scheduler.kv_manager.check_integrity()
        if draft == directory:  # stale draft KV after a preemption would show as rejected drafts
            assert engine.stats()["spec_acceptance_rate"] == 1.0


def test_seeded_sampling_is_unchanged(target, other_draft):
    directory, _ = target
    batch = prompts([8, 15], seed=4)
    params = [{"temperature": 0.8, "seed": 21 + i, "ignore_eos": True, "max_tokens": MAX_NEW} for i in range(2)]
    plain = Engine(EngineConfig(model=str(directory), num_blocks=128, block_size=4), load_tokenizer=False)
    expected = [plain.generate([p], q)[0].token_ids for p, q in zip(batch, params)]
    for draft in (directory, other_draft):
        engine = engine_for(directory, draft)
        assert [engine.generate([p], q)[0].token_ids for p, q in zip(batch, params)] == expected


# Sampling settings whose rule the drafts mirror: plain (columns in order), top-p alone (its nucleus
# in column order), top-k and min-p (tokens by probability).
SAMPLED = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8}, {"temperature": 1.0, "top_k": 20},
           {"temperature": 1.2, "min_p": 0.05, "top_p": 0.9}]


@pytest.mark.parametrize("sampling", SAMPLED)
@pytest.mark.parametrize("seeded", [False, True])
def test_a_sampled_requests_drafts_are_kept_as_often_as_a_greedy_ones(target, sampling, seeded):
    """The target as its own draft: a sampled request's drafts are samples with its rows' own
    uniform numbers, so (nearly) every one is kept -- greedy drafts of this tiny model's flat
    distributions would be kept with the few percent the model gives its argmax."""
    directory, _ = target
    engine = engine_for(directory, directory)
    batch = prompts([9, 23, 14], seed=6)
    params = [{**sampling, "ignore_eos": True, "max_tokens": MAX_NEW, "seed": 40 + i if seeded else None}
              for i in range(len(batch))]
    for prompt, param in zip(batch, params):
        engine.add_request(prompt, param)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["spec_verifications_total"] >= len(batch) * 2
    assert stats["spec_acceptance_rate"] > 0.9
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_draft_of_another_vocabulary_is_refused(target, tmp_path):
    directory, _ = target
    draft = write_checkpoint(tiny_llama_config(vocab_size=VOCAB * 2), tmp_path / "wide")
    with pytest.raises(ValueError, match="must share the tokenizer"):
        engine_for(directory, draft)
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model=str(directory), speculative="draft")
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineConfig(model=str(directory), speculative="draft", draft_model=str(directory), draft_quantization="int3")
