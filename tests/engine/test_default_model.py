"""The real default model, Gemma 3 270M from PyPI: greedy parity with transformers in fp32, with
n-gram speculation off and on (the prompts repeat themselves, so drafts are proposed and accepted)."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.loading.default_model import ensure_default_model
from common.engine.engine import Engine

PROMPTS = [
    "The capital of Germany is Berlin. The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 20

pytestmark = pytest.mark.slow(seconds=57)  # a long file: scheduled by its length (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_default_model()


def test_greedy_parity_with_transformers(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A small token budget so the prompts are also chunked and batched beside each other's decodes.
    runs = {}
    prompts = PROMPTS
    for speculative in ("none", "ngram"):
        # The second engine takes the first one's token ids (its 262k-token tokenizer loads once).
        engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", num_blocks=64,
                                     max_num_batched_tokens=16, speculative=speculative, ngram_min=1,
                                     speculative_min_accepted=0.0, speculative_cost_gate=False),
                        load_tokenizer=speculative == "none")
        runs[speculative] = engine.generate(prompts, {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        prompts = [r.prompt_token_ids for r in runs[speculative]]
        accepted = engine.stats()["spec_accepted_tokens_total"]
        del engine
    assert accepted > 0, "speculation never had a draft accepted: the run with it tested nothing"
    assert [r.token_ids for r in runs["ngram"]] == [r.token_ids for r in runs["none"]]
    results = runs["none"]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, results):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert result.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert result.token_ids == out[0, ids.shape[1]:].tolist(), prompt
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert "Paris" in results[0].text
