"""A draft model's reduced vocabulary (``speculative.draft_vocabulary``): its tokenizer's ranking
picks the common tokens, the draft's greedy token is the best of those and its request's own tokens,
a sampled one is drawn from their logits in id order, and verification keeps the output the target's
whatever the draft can propose."""
import json
from types import SimpleNamespace

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampler import Sampler
from common.engine.sampling_params import SamplingParams
from common.engine.speculative.draft_sampling import sample_drafts
from common.engine.speculative.draft_vocabulary import rank_tokens
from tests.support.checkpoints import VOCAB, GreedyReference, tiny_llama_config, write_checkpoint, write_tokenizer

GREEDY = {"temperature": 0.0, "ignore_eos": True}
COMMON = 64  # of the tiny vocabulary's 512


def _tokenizer_json(directory, model: dict):
    (directory / "tokenizer.json").write_text(json.dumps({"model": model}))
    return directory


def test_bpe_merges_rank_tokens_by_their_first_merge(tmp_path):
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "z": 5, "<eos>": 6, "ca": 7}
    # "ab c" forms abc from ab and c; "c a" comes last; z and <eos> take part in no merge
    for merges in (["a b", "ab c", "c a"], [["a", "b"], ["ab", "c"], ["c", "a"]]):
        _tokenizer_json(tmp_path, {"type": "BPE", "vocab": vocab, "merges": merges})
        assert rank_tokens(tmp_path) == [0, 1, 3, 2, 4, 7]


def test_unigram_pieces_rank_by_score_and_other_vocabularies_not_at_all(tmp_path):
    _tokenizer_json(tmp_path, {"type": "Unigram", "vocab": [["x", -1.0], ["y", -0.5], ["z", -3.0]]})
    assert rank_tokens(tmp_path) == [1, 0, 2]
    _tokenizer_json(tmp_path, {"type": "WordPiece", "vocab": {"x": 0}})
    assert rank_tokens(tmp_path) is None
    _tokenizer_json(tmp_path, {"type": "BPE", "vocab": {"x": 0}, "merges": []})
    assert rank_tokens(tmp_path) is None
    assert rank_tokens(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny model with a BPE tokenizer of its vocabulary: it drafts for itself."""
    directory = write_checkpoint(tiny_llama_config(), tmp_path_factory.mktemp("with_tokenizer"))
    write_tokenizer(directory)
    return directory, GreedyReference(directory, 20)


def engine_for(directory, **overrides):
    fields = dict(model=str(directory), num_blocks=128, block_size=4, max_num_batched_tokens=512,
                  speculative="draft", draft_model=str(directory), num_speculative_tokens=4,
                  speculative_min_accepted=0.0, speculative_cost_gate=False, draft_vocab_size=COMMON)
    fields.update(overrides)
    return Engine(EngineConfig(**fields), load_tokenizer=False)


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_the_draft_proposes_the_best_common_or_own_token(target, tmp_path, monkeypatch, scheme):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    directory, _ = target
    proposer = engine_for(directory, draft_quantization=scheme).scheduler.speculation.proposer
    head = proposer.head
    common = head.ids.tolist()
    assert len(common) == COMMON and 2 in common  # the configured size, the end-of-sequence token among them
    assert common == sorted(set(rank_tokens(directory)[:COMMON - 1]) | {2})  # its tokenizer's most common
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, proposer.config.hidden_size, generator=g)
    logits = proposer.model.logits(hidden).float()
    global_best = logits.argmax(dim=-1)
    rows = [r for r in range(len(hidden)) if int(global_best[r]) not in set(common)][:8]
    assert rows  # hidden states whose best token is not a common one
    for row in rows:
        token = int(global_best[row])
        x = hidden[row:row + 1]
        stranger = SimpleNamespace(request_id=f"s{row}", all_token_ids=[5, 6, 7])  # without that token
        owner = SimpleNamespace(request_id=f"o{row}", all_token_ids=[5, token, 7])
        for request, expect_token in ((stranger, False), (owner, True)):
            allowed = sorted(set(common) | set(request.all_token_ids))
            proposed = head.greedy(x, [request])[0]
            assert proposed in allowed
            assert (proposed == token) == expect_token
            best = logits[row, allowed].max()
            # fp32: the best allowed token; int8: within the kernel's rounding of the activations
            tolerance = 1e-5 if scheme == "none" else 0.02 * float(logits[row].max() - logits[row].min())
            assert float(logits[row, proposed]) >= float(best) - tolerance


def test_a_sampled_draft_scores_the_common_and_own_tokens_in_id_order(target):
    """What a sampled request's draft is drawn from (``draft_sampling``): the logits of the common
    tokens and the request's own, merged in ascending id order, equal to the model's at those ids."""
    directory, _ = target
    proposer = engine_for(directory).scheduler.speculation.proposer
    head = proposer.head
    hidden = torch.randn(2, proposer.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = proposer.model.logits(hidden).float()
    common = head.ids.tolist()
    outside = [t for t in range(VOCAB - 1, 0, -1) if t not in set(common)][:3]
    requests = [SimpleNamespace(request_id="a", all_token_ids=[outside[1], common[5]]),
                SimpleNamespace(request_id="b", all_token_ids=[common[5]])]
    head.scores(hidden, requests)
    requests[0].all_token_ids += [outside[2], outside[0]]  # own tokens kept in the order they came
    ids, scored = head.scores(hidden, requests)
    assert ids.tolist() == sorted(set(common) | set(outside))
    mine = [set(common) | set(outside), set(common)]  # each row's: -inf at the other's own tokens
    for row in range(2):
        inside = torch.tensor([int(t) in mine[row] for t in ids])
        torch.testing.assert_close(scored[row, inside], logits[row, ids[inside]], rtol=1e-5, atol=1e-5)
        assert bool(torch.isinf(scored[row, ~inside]).all())
    # the sampled draft is the token its number picks there, by the target's sampler
    sampled = SamplingParams(temperature=1.0)
    requests[0].sampling_params = requests[1].sampling_params = sampled
    drafts = head.drafts(hidden, requests, [0.3, 0.6])
    assert drafts == [int(ids[c]) for c in sample_drafts(Sampler(), scored.clone(), [sampled] * 2, [0.3, 0.6], VOCAB)]
    assert head.drafts(hidden, requests, [None, None]) == head.greedy(hidden, requests)


def test_output_is_the_targets_whatever_the_draft_can_propose(target):
    directory, reference = target
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 23, 14)]
    for size in (COMMON, 0):
        engine = engine_for(directory, draft_vocab_size=size)
        proposer = engine.scheduler.speculation.proposer
        assert (proposer.head.ids is None) == (size == 0)
        results = engine.generate(batch, {**GREEDY, "max_tokens": 21})
        assert [r.token_ids for r in results] == [reference(p, 21) for p in batch]
        assert engine.stats()["spec_verifications_total"] > 0
        assert not getattr(proposer.head, "_own", {})  # finished requests' own tokens forgotten
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_negative_draft_vocabulary_is_refused(target):
    directory, _ = target
    with pytest.raises(ValueError, match="draft_vocab_size"):
        EngineConfig(model=str(directory), speculative="draft", draft_model=str(directory), draft_vocab_size=-1)
