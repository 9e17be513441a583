"""Structured output served: a real gateway, prefill and decode workers, Redis and the official
openai client.  Sampled outputs match their schema every time, whether the prompt is computed by
the decode worker itself (short) or by the prefill pool (long: the prefill worker samples the first
token under the grammar, the decode worker's matcher continues from it); streamed equals
non-streamed under greedy; bad grammars are 400s naming their field and harm nothing."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.support.checkpoints import TRAINING_TEXT

pytestmark = pytest.mark.slow(seconds=15)  # a long file: scheduled by its length (tests/conftest.py)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "open": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["city", "rank", "open", "kind"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
SHORT = "Where to go:"  # under --skip-prefill-below (64 tokens): computed by the decode worker
LONG = "Structured: " + " ".join(TRAINING_TEXT) * 2  # over it: computed by the prefill worker
# (each file's long prompt starts with its own word: another file's cached blocks would let these skip the prefill pool)


def chat(client, stack, content, **params):
    return client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": content}],
                                          max_tokens=params.pop("max_tokens", 80), **params)


def test_json_schema_sampled_is_valid_every_time_short_and_through_the_prefill_pool(client, stack):
    prefilled_before = stack.stats("p0")["prefill_computed_tokens"]
    fallbacks_before = stack.stats("d0")["remote_prefill_fallbacks"]
    for seed in range(6):
        for prompt in (f"{SHORT} {seed}", f"{LONG} {seed}"):
            response = chat(client, stack, prompt, temperature=1.0, seed=seed, response_format=FORMAT)
            choice = response.choices[0]
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert stack.stats("p0")["prefill_computed_tokens"] > prefilled_before  # the long prompts went there
    # ... and the prefill worker's first tokens obeyed the grammar: the decode worker took every
    # one (a first token its matcher refuses would make it compute the prompt itself).
    assert stack.stats("d0")["remote_prefill_fallbacks"] == fallbacks_before


def test_completions_json_schema_through_the_prefill_pool(client, stack):
    for seed in range(4):
        response = client.completions.create(model=stack.model_name, prompt=f"{LONG} completion {seed}",
                                             max_tokens=80, temperature=0.9, seed=seed,
                                             extra_body={"response_format": FORMAT})
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].text), SCHEMA)


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    rank: int = pydantic.Field(ge=1, le=99)
    kind: Literal["a", "b", "c"]


def test_parse_with_a_pydantic_model(client, stack):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=stack.model_name, messages=[{"role": "user", "content": f"{LONG} parse {seed}"}],
            response_format=Place, temperature=1.0, seed=seed, max_tokens=80)
        place = completion.choices[0].message.parsed
        assert isinstance(place, Place)


def test_streamed_equals_non_streamed_under_greedy(client, stack):
    for prompt in (f"{SHORT} greedy", f"{LONG} greedy"):
        whole = chat(client, stack, prompt, temperature=0, response_format=FORMAT).choices[0].message.content
        stream = chat(client, stack, prompt, temperature=0, response_format=FORMAT, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == whole
        jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_regex_choice_and_grammar(client, stack):
    obj = chat(client, stack, f"{LONG} object", temperature=0.7, seed=1, max_tokens=200,
               response_format={"type": "json_object"}).choices[0]
    if obj.finish_reason == "stop":  # an open-ended object may run long on a random model
        assert isinstance(json.loads(obj.message.content), dict)
    cases = [({"regex": r"[A-Z][a-z]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", t)),
             ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
             ({"grammar": 'start: "<" ("x" | "y")+ ">"'}, lambda t: re.fullmatch(r"<[xy]+>", t))]
    for constraint, valid in cases:
        for seed, prompt in enumerate((SHORT, LONG)):
            choice = chat(client, stack, f"{prompt} {constraint}", temperature=1.0, seed=seed, max_tokens=60,
                          extra_body={"structured_outputs": constraint}).choices[0]
            assert choice.finish_reason == "stop" and valid(choice.message.content), (constraint, choice)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "c{1000000}"}}, "structured_outputs"),  # past the bounds on its work
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_grammars_are_400s_naming_the_field(client, stack, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stack, SHORT, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    # The stack is unharmed.
    assert chat(client, stack, SHORT, max_tokens=3, temperature=0).choices[0].finish_reason in ("length", "stop")


def test_logit_bias_and_min_tokens(client, stack):
    forced = client.completions.create(model=stack.model_name, prompt=f"{LONG} bias", max_tokens=5, temperature=1.0,
                                       seed=3, logit_bias={"77": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens and len(set(forced.choices[0].logprobs.tokens)) == 1
    eos = 2  # tests.support.checkpoints: the tiny tokenizer's <eos>
    early = client.completions.create(model=stack.model_name, prompt=f"{SHORT} eos", max_tokens=8, temperature=0,
                                      logit_bias={str(eos): 100})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    held = client.completions.create(model=stack.model_name, prompt=f"{SHORT} eos", max_tokens=8, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5
    fallbacks = stack.stats("d0")["remote_prefill_fallbacks"]
    prefilled = stack.stats("p0")["prefill_computed_tokens"]
    # A prompt no other test sends, long enough for the prefill pool (nothing of it cached anywhere).
    long_held = client.completions.create(model=stack.model_name, prompt=f"Held back: {LONG}", max_tokens=8,
                                          temperature=0, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert long_held.usage.completion_tokens == 4
    assert stack.stats("p0")["prefill_computed_tokens"] > prefilled
    # The prefill worker sampled the first token under min_tokens too (it once refused the request).
    assert stack.stats("d0")["remote_prefill_fallbacks"] == fallbacks
