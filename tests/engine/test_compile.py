"""torch.compile of the decoder layers (``EngineConfig.compile``): greedy parity with transformers
in fp32 across every token bucket, no recompiles after start-up, eager when compiling fails."""
import logging

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.models import stages
from tests.support.checkpoints import VOCAB, hf_greedy, tiny_gemma3_config, write_checkpoint

pytestmark = pytest.mark.slow(seconds=21)  # a long file: scheduled by its length (tests/conftest.py)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # Gemma 3 has every branch the halves take: sandwich norms, q/k norms, sliding and full layers.
    return write_checkpoint(tiny_gemma3_config(), tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def compiled_engine(gemma3):
    return Engine(EngineConfig(model=str(gemma3), num_blocks=256, block_size=4, max_num_batched_tokens=1024,
                               compile=True), load_tokenizer=False)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_compiled_engine_matches_transformers(gemma3, compiled_engine):
    assert compiled_engine.model.stages.compiled
    # 600 tokens: one step past ``ONEDNN_MAX_ROWS`` (the 512+ bucket); then 2..511-token steps
    # (the other prompts' prefill beside decodes) and 1-token steps (a lone decode at the end).
    batch = prompts([600, 5, 37])
    results = compiled_engine.generate(batch, {**GREEDY, "max_tokens": 6})
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(gemma3, prompt, 6)
    lone = prompts([9], seed=1)[0]
    assert compiled_engine.generate([lone], {**GREEDY, "max_tokens": 4})[0].token_ids == hf_greedy(gemma3, lone, 4)


def test_no_recompiles_after_start_up(compiled_engine):
    from torch._dynamo.utils import counters

    compiled_engine.generate(prompts([3, 70, 200], seed=2), {**GREEDY, "max_tokens": 3})  # settle
    before = counters["stats"]["unique_graphs"]
    # New token counts in every bucket, batch sizes not seen before.
    compiled_engine.generate(prompts([1, 2, 11, 513, 90, 33, 7], seed=3), {**GREEDY, "max_tokens": 5})
    assert before > 0  # the counter counts this engine's graphs
    assert counters["stats"]["unique_graphs"] == before


def test_compile_failure_runs_eagerly(gemma3, monkeypatch, caplog):
    def broken(model, compiled):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(stages, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="common.engine.models.stages"):
        engine = Engine(EngineConfig(model=str(gemma3), num_blocks=64, block_size=4, compile=True),
                        load_tokenizer=False)
    assert engine.model.stages is stages.EAGER
    assert "no C++ compiler" in caplog.text
    prompt = prompts([12], seed=4)[0]
    assert engine.generate([prompt], {**GREEDY, "max_tokens": 4})[0].token_ids == hf_greedy(gemma3, prompt, 4)
