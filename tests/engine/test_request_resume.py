"""A request resumed after output tokens another worker streamed (``resume_request``, what a moved
stream sends) continues exactly as the uninterrupted request: greedy, seeded sampling with
penalties, and under a grammar, from any cut; tokens it could not have produced are refused."""
import json

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from common.engine.structured.spec import StructuredOutput
from tests.support.checkpoints import tiny_llama_config, write_checkpoint, write_tokenizer

PROMPT = [5, 9, 13, 17, 21, 3, 8, 40, 41]
MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["name", "n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume")
    write_checkpoint(tiny_llama_config(), directory)
    write_tokenizer(directory)
    # Small blocks and pool: a resumed request's KV spans several blocks and is computed in chunks.
    return Engine(EngineConfig(model=str(directory), num_blocks=64, block_size=4, max_num_batched_tokens=8))


def continuation(engine, prompt, params, resumed) -> list[int]:
    """The tokens a request resumed after ``resumed`` produces."""
    request_id = engine.add_request(prompt, params, resume_token_ids=resumed)
    tokens = []
    while True:
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens


@pytest.mark.parametrize("params", [
    {"temperature": 0.0, "ignore_eos": True},
    {"temperature": 0.9, "top_p": 0.9, "seed": 3, "ignore_eos": True, "presence_penalty": 0.5,
     "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_tokens": 20},
], ids=["greedy", "seeded-penalties"])
def test_a_resumed_request_continues_as_the_uninterrupted_one(engine, params):
    params = {**params, "max_tokens": MAX_TOKENS}
    whole = engine.generate([PROMPT], params)[0].token_ids
    assert len(whole) == MAX_TOKENS
    for cut in (1, 2, 9, MAX_TOKENS - 1):
        assert whole[:cut] + continuation(engine, PROMPT, params, whole[:cut]) == whole, cut
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_resumed_request_keeps_its_grammar(engine):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=60,
                            structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    whole = engine.generate([PROMPT], params)[0].token_ids
    text = engine.tokenizer.decode(whole, skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "n"}
    for cut in (1, len(whole) // 2):
        assert whole[:cut] + continuation(engine, PROMPT, params, whole[:cut]) == whole, cut


def test_tokens_it_could_not_have_produced_are_refused(engine):
    eos = engine.model_config.eos_token_ids[0]
    grammar = SamplingParams(max_tokens=30, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    cases = [
        ({"max_tokens": 4}, [7, 8, 9, 10], "length"),  # max_tokens reached: it had ended
        ({"max_tokens": 8}, [7, eos], "stop token"),
        ({"max_tokens": 8}, [7, -1], "integers"),
        (grammar, engine.tokenizer("not json").input_ids, "grammar"),
    ]
    for params, resumed, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(PROMPT, params, resume_token_ids=resumed)
    assert not engine.scheduler.requests
