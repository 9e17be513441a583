"""Speculative decoding served: the shared small stack's decode worker runs n-gram speculation
(tests/conftest.py), so through the gateway, the prefill pool and the KV transfer, greedy streams
and seeded sampled streams must equal the offline engine without speculation, token for token,
while the decode worker really verifies drafts (its /stats count them)."""
from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.checkpoints import TRAINING_TEXT

# Repeated text: the lookup finds spans to propose; long enough to go through the prefill pool.
PROMPT = " ".join(TRAINING_TEXT[:6]) + " " + " ".join(TRAINING_TEXT[:6]) + " speculation"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def offline(served_checkpoint):
    """The offline engine without speculation: ``run(**params) -> text``."""
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=128, block_size=4))
    assert not engine.config.speculation.enabled

    def run(**params) -> str:
        ids = engine.tokenizer(PROMPT).input_ids
        return engine.generate([ids], {"max_tokens": MAX_TOKENS, "ignore_eos": True, **params})[0].text

    return run


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_answers_equal_the_engine_without_speculation(client, stack, offline, params):
    before = stack.stats("d0")
    kwargs = dict(model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
                  **params)
    text = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                       if chunk.choices)
    assert text == streamed == offline(**params)
    after = stack.stats("d0")
    assert after["spec_verifications_total"] > before["spec_verifications_total"]  # drafts were verified
    assert after["remote_prefill_fallbacks"] == before["remote_prefill_fallbacks"]
    assert 0.0 <= after["spec_acceptance_rate"] <= 1.0
