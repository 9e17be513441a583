"""A request's choice as the engine runs it (gateway/engine_params.py): bounds checked against the model."""
from __future__ import annotations

import pytest

from gateway.engine_params import engine_params
from gateway.openai_errors import OpenAIError
from gateway.sampling_options import SamplingOptions

MAX_MODEL_LEN, VOCAB = 64, 100


def options(**fields) -> SamplingOptions:
    base = dict(max_tokens=None, temperature=0.0, top_p=1.0, top_k=None, min_p=0.0, presence_penalty=0.0,
                frequency_penalty=0.0, repetition_penalty=1.0, seed=None, stop=(), ignore_eos=False, logprobs=None,
                stream=False, include_usage=False)
    return SamplingOptions(**(base | fields))


def params(prompt_len: int = 10, **fields):
    return engine_params(options(**fields), "completion", False, list(range(1, prompt_len + 1)), None,
                         max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, turn_end=())


@pytest.mark.parametrize("max_tokens, min_tokens, prompt_len", [(8, 9, 10), (None, 55, 10), (None, 2, 63)])
def test_min_tokens_beyond_what_the_output_may_have_is_a_400_naming_it(max_tokens, min_tokens, prompt_len):
    """As vLLM: an output could never have min_tokens tokens (it used to be clamped silently)."""
    with pytest.raises(OpenAIError) as info:
        params(prompt_len, max_tokens=max_tokens, min_tokens=min_tokens)
    assert info.value.status == 400 and info.value.param == "min_tokens"
    assert f"min_tokens ({min_tokens})" in info.value.message


@pytest.mark.parametrize("max_tokens, min_tokens, prompt_len", [(8, 8, 10), (None, 54, 10), (8, 0, 10)])
def test_min_tokens_up_to_the_outputs_bound_is_kept(max_tokens, min_tokens, prompt_len):
    sampling, _ = params(prompt_len, max_tokens=max_tokens, min_tokens=min_tokens)
    assert sampling.min_tokens == min_tokens
    assert sampling.max_tokens == (max_tokens if max_tokens is not None else MAX_MODEL_LEN - prompt_len)


def test_a_prompt_past_the_context_is_refused_as_such_before_min_tokens_is_checked():
    with pytest.raises(OpenAIError) as info:
        params(MAX_MODEL_LEN + 5)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
