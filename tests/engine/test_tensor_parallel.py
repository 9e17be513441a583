"""Tensor parallelism in the engine, on CPU with gloo: one process per rank, each holding its
share of every layer (and its kv heads of the KV cache); rank 0 schedules and sends each step, the
others follow.  Greedy outputs at TP=2 and TP=4 equal TP=1's and transformers'; with fewer kv heads than ranks (Gemma 3's one) the kv heads are
replicated and the outputs still equal."""
from __future__ import annotations

import json

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.models import stages
from common.engine.parallel.tensor_parallel import TensorParallel
from common.engine.sampler import Sampler
from tests.support.checkpoints import VOCAB, hf_greedy, tiny_gemma3_config, tiny_llama_config, write_checkpoint
from tests.support.rank_group import run_group

pytestmark = pytest.mark.slow(seconds=48)  # a long file: scheduled by its length (tests/conftest.py)

MAX_NEW = 10
PROMPTS = [[5, 17, 99, 230, 11], list(range(3, 40)), [400, 401, 7, 7, 7, 9, 300, 12, 1, 250]]


def _rank(rank: int, size: int, directory: str, out: str, compile_stages: bool, prompts: list[list[int]],
          prompt_logprobs: int | None = None) -> None:
    if compile_stages:  # these prompts' steps stay below ONEDNN_MAX_ROWS: the first bucket's graphs are all they run
        stages.WARM_UP_TOKENS = stages.WARM_UP_TOKENS[:1]
    # Each rank asks for a different pool: they agree on the smallest (the block ids are shared).
    engine = Engine(EngineConfig(model=directory, num_blocks=64 + 8 * (size - 1 - rank), block_size=4,
                                 tensor_parallel_size=size, compile=compile_stages), load_tokenizer=False)
    if rank != 0:  # rank 0 schedules and sends each step; the others compute their shares
        engine.follow()
        return
    results = engine.generate(prompts, {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                                        "prompt_logprobs": prompt_logprobs})
    engine.stop_followers()
    with open(out, "w") as f:
        json.dump({"tokens": [r.token_ids for r in results], "kv_heads": engine.layout.num_kv_heads,
                   "scores": [_scores(r.prompt_logprobs) for r in results],
                   "num_blocks": engine.block_pool.num_blocks, "compiled": engine.model.stages.compiled}, f)


def _scores(entries) -> list | None:
    return None if entries is None else [[e.token_id, e.logprob, [list(t) for t in e.top]] for e in entries]


def run_tp(directory, size: int, tmp_path, compile_stages: bool = False, prompts=PROMPTS,
           prompt_logprobs: int | None = None) -> dict:
    out = tmp_path / f"tp{size}-{compile_stages}.json"
    run_group(_rank, size, str(directory), str(out), compile_stages, prompts, prompt_logprobs)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # 8 query heads, 4 kv heads: split at TP=2 and TP=4.
    return write_checkpoint(tiny_llama_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64,
                                              intermediate_size=128), tmp_path_factory.mktemp("llama8x4"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    # One kv head (Gemma 3 270M's shape): replicated on both ranks at TP=2.
    return write_checkpoint(tiny_gemma3_config(), tmp_path_factory.mktemp("gemma1kv"))


def single(directory, prompts=PROMPTS) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(directory), num_blocks=64, block_size=4), load_tokenizer=False)
    return [r.token_ids for r in engine.generate(prompts, {"max_tokens": MAX_NEW, "temperature": 0,
                                                           "ignore_eos": True})]


@pytest.mark.parametrize("size", [2, 4])
def test_split_kv_heads_equal_one_rank_and_transformers(llama, tmp_path, size):
    expected = single(llama)
    assert expected == [hf_greedy(llama, p, MAX_NEW) for p in PROMPTS]
    result = run_tp(llama, size, tmp_path)
    assert result["kv_heads"] == 4 // size  # each rank's KV cache holds its share of the heads
    assert result["num_blocks"] == 64  # the smallest pool any rank asked for
    assert result["tokens"] == expected


def test_biases_are_split_and_added_once(tmp_path_factory, tmp_path):
    """q/k/v biases go with their heads; the row-parallel o_proj's bias is added once, after the sum."""
    from safetensors.torch import load_file, save_file

    biased = write_checkpoint(tiny_llama_config(num_attention_heads=8, num_key_value_heads=4, attention_bias=True),
                              tmp_path_factory.mktemp("llama-bias"))
    weights = biased / "model.safetensors"
    state = load_file(weights)
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in state if n.endswith("_proj.bias")]:  # transformers starts biases at zero
        state[name] = torch.randn(state[name].shape, generator=generator)
    save_file(state, weights, metadata={"format": "pt"})
    assert run_tp(biased, 2, tmp_path)["tokens"] == single(biased)


def test_replicated_kv_head_equals_one_rank(gemma, tmp_path):
    result = run_tp(gemma, 2, tmp_path)
    assert result["kv_heads"] == 1
    assert result["tokens"] == single(gemma)


def test_shares_and_refusals():

    tp = TensorParallel(size=4, rank=3)
    assert tp.split(8, "heads") == slice(6, 8) and tp.vocab(VOCAB + 1) == slice(387, 513)
    assert TensorParallel(size=4, rank=2).kv_heads(8, 2) == slice(1, 2)  # q heads 4,5 use kv head 1
    with pytest.raises(ValueError, match="must divide by the tensor-parallel size 4"):
        tp.split(6, "the attention heads")
    with pytest.raises(ValueError, match="cannot be split or replicated"):
        TensorParallel(size=4, rank=0).kv_heads(12, 3)
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        TensorParallel.of_process_group(2)


def test_prompt_logprobs_at_tp2_equal_one_rank(llama, tmp_path):
    """Scoring the prompts: the step tells the followers which rows are scored, every rank takes
    part in their projections (the vocabulary is gathered on rank 0), and the scores are one
    rank's (a rank that skipped a projection would hang the group)."""
    engine = Engine(EngineConfig(model=str(llama), num_blocks=64, block_size=4), load_tokenizer=False)
    expected = engine.generate(PROMPTS, {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                                         "prompt_logprobs": 2})
    result = run_tp(llama, 2, tmp_path, prompt_logprobs=2)
    assert result["tokens"] == [r.token_ids for r in expected]
    for got, want in zip(result["scores"], expected):
        assert [e[0] for e in got] == [e.token_id for e in want.prompt_logprobs]
        assert [e[1] for e in got] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-4)
        assert [[t for t, _ in e[2]] for e in got] == [[t for t, _ in e.top] for e in want.prompt_logprobs]


def test_a_step_survives_its_encoding():
    from common.engine.parallel.step_broadcast import decode_step, encode_step
    from common.engine.sampling_params import SamplingParams
    from common.engine.scheduler_output import ScheduledRequest, SchedulerOutput

    items = [ScheduledRequest("a", [5, 6, 7], 0, [3, 9], False, SamplingParams(), 0),
             ScheduledRequest("b", [8], 41, [1, 2, 4, 11, 12, 13], True, SamplingParams(), 2),
             ScheduledRequest("c", [8, 4, 4, 9], 17, [5, 6], True, SamplingParams(), 3, draft_token_ids=[4, 4, 9]),
             ScheduledRequest("d", [3, 1, 4, 1, 5], 2, [7, 8], False, SamplingParams(), 0, prompt_logprob_rows=(1, 5))]
    decoded = decode_step(encode_step(SchedulerOutput(items, 13)))
    fields = ("token_ids", "num_computed_tokens", "block_ids", "sample", "draft_token_ids", "prompt_logprob_rows")
    assert [[getattr(s, f) for f in fields] for s in decoded.scheduled] == \
        [[getattr(s, f) for f in fields] for s in items]  # the followers sample (and score) the same rows
    assert decoded.num_scheduled_tokens == 13


def test_tp2_compiled_equals_one_rank(llama, tmp_path):
    """torch.compile under TP: the halves around attention, their all-reduces inside, compiled on
    every rank alike; a prompt past ``MIN_COMPILED_TOKENS`` runs the compiled path."""
    prompts = [list(range(3, 140)), *PROMPTS[1:]]
    got = run_tp(llama, 2, tmp_path, compile_stages=True, prompts=prompts)
    assert got["compiled"], "the stages were not compiled under TP"
    assert got["tokens"] == single(llama, prompts)


class _FailingSampler(Sampler):
    def __call__(self, *args, **kwargs):
        raise RuntimeError("a sampling fault on rank 0 alone")


def _rank_failing_after_the_send(rank: int, size: int, directory: str, out: str) -> None:
    engine = Engine(EngineConfig(model=directory, num_blocks=64, block_size=4, tensor_parallel_size=size),
                    load_tokenizer=False)
    if rank != 0:
        try:
            engine.follow()
        except Exception:  # rank 0 left in the middle of the step: its collective ends in an error here
            pass
        return
    engine.runner.sampler = _FailingSampler()
    engine.add_request([5, 17, 99, 230], {"max_tokens": 4, "temperature": 1.0, "ignore_eos": True})
    try:
        engine.step()
        outcome = "went on"
    except Exception as exc:
        outcome = type(exc).__name__
    with open(out, "w") as f:
        json.dump({"outcome": outcome}, f)


def test_a_step_that_fails_on_rank_0_after_the_other_ranks_have_it_stops_the_engine(gemma, tmp_path):
    """The other ranks run the step's forward and wait for rank 0's tokens; a failure on rank 0
    alone (its sampler, a grammar mask) leaves them there, or makes them take its next step's
    broadcast for these tokens.  So it is not a ``StepFailed`` (the requests fail, the engine goes
    on) but ``RanksOutOfStep``: the worker's engine thread stops for good."""
    out = tmp_path / "failing.json"
    run_group(_rank_failing_after_the_send, 2, str(gemma), str(out))
    assert json.loads(out.read_text()) == {"outcome": "RanksOutOfStep"}
