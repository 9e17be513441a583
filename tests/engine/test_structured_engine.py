"""Structured output in the engine: every sampled output matches its grammar (JSON schema, regex,
choice, Lark and GBNF grammars), with either backend, across preemption and recompute; logit
bias and min_tokens act on the logits before sampling."""
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import GrammarError
from common.engine.structured.spec import StructuredOutput
from tests.support.checkpoints import tiny_llama_config, write_checkpoint, write_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fox"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    write_checkpoint(tiny_llama_config(), d)
    write_tokenizer(d)
    return d


def engine_for(directory, **overrides):
    fields = dict(model=str(directory), num_blocks=256, block_size=4, max_num_batched_tokens=256)
    fields.update(overrides)
    return Engine(EngineConfig(**fields))


@pytest.fixture(scope="module")
def engine(directory):
    return engine_for(directory)


def sampled(structured, seed, **fields):
    return SamplingParams(max_tokens=fields.pop("max_tokens", 120), temperature=1.0, seed=seed,
                          structured=structured, **fields)


def test_json_schema_sampled_outputs_all_validate(engine):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts = ["The quick brown fox", "Hello world! " * 20, "KV cache blocks move"]
    for seed in range(8):
        results = engine.generate(prompts, sampled(spec, seed))
        for result in results:
            assert result.finish_reason == "stop", result
            jsonschema.validate(json.loads(result.text), SCHEMA)


def test_free_sampling_is_not_json(engine):
    """The random model does not produce valid JSON by itself: the grammar is what makes it so."""
    results = engine.generate(["The quick brown fox"] * 4, SamplingParams(max_tokens=40, temperature=1.0, seed=3))
    for result in results:
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(result.text), SCHEMA)


def test_json_object_regex_choice_and_grammars(engine):
    cases = [
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutput("regex", r"[a-z]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
        (StructuredOutput("choice", json.dumps(["yes", "no", "maybe"])), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutput("grammar", 'start: "A" ("B" | "C")+ "."\n'), lambda t: re.fullmatch(r"A[BC]+\.", t)),
        (StructuredOutput("grammar", 'root ::= "x" [0-9] [0-9]'), lambda t: re.fullmatch(r"x\d\d", t)),
    ]
    for spec, valid in cases:
        for seed in range(4):
            schema_ok = spec.kind != "json_object"
            result = engine.generate(["Hello"], sampled(spec, seed, max_tokens=200 if schema_ok else 400))[0]
            if spec.kind == "json_object" and result.finish_reason == "length":
                continue  # an open object may run long on a random model; what it produced is checked below
            assert result.finish_reason == "stop", (spec, result)
            assert valid(result.text), (spec, result.text)


def test_greedy_structured_equals_across_preemption_and_recompute(directory):
    """A pool too small for the batch preempts requests (their KV recomputed later): the grammar
    state lives with the output tokens, so the outputs are those of an unpreempted run."""
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts = [f"The quick brown fox {i} " * 6 for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=spec)
    roomy = engine_for(directory).generate(prompts, params)
    tight_engine = engine_for(directory, num_blocks=40, max_num_batched_tokens=64)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    for r in tight:
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", "{not json"),
    StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})),
    StructuredOutput("regex", "(unclosed"),
    StructuredOutput("grammar", "start: undefined_rule\n"),
    StructuredOutput("choice", "[]"),
    # Past the bounds on a grammar's work at its first token: at compile, not once generation started.
    StructuredOutput("regex", "c{1000000}"),
    StructuredOutput("json_schema", json.dumps({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"})),
    # Bounds past 2^53, which the backends would round (and let through what breaks them).
    StructuredOutput("json_schema", json.dumps({"type": "integer", "minimum": 2 ** 63, "maximum": 2 ** 63 + 5})),
    StructuredOutput("json_schema", json.dumps({"properties": {"n": {"type": "integer", "maximum": -10 ** 30}}})),
    StructuredOutput("json_schema", json.dumps({"type": "integer", "minimum": 2 ** 53 + 1, "maximum": 2 ** 53 + 1})),
])
def test_bad_specs_are_grammar_errors_naming_the_field(engine, spec):
    with pytest.raises(GrammarError, match="^response_format"):
        engine.make_request("Hello", SamplingParams(structured=spec))
    # The engine is unharmed.
    assert engine.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0].finish_reason == "length"


def test_xgrammar_backend(directory):
    engine = engine_for(directory, structured_output_backend="xgrammar")
    # No free strings: xgrammar reads this toy byte-level vocabulary's control bytes as text.
    schema = {**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "name"},
              "required": ["age", "pet", "ok"]}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    for seed in range(3):
        result = engine.generate(["Hello"], sampled(spec, seed))[0]
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), schema)
    # A complete grammar ends the request even before min_tokens (xgrammar's mask then allows the
    # stop tokens only): a stop, not an error.
    choice = StructuredOutput("choice", json.dumps(["yes"]))
    result = engine.generate(["Hello"], SamplingParams(max_tokens=20, temperature=0, min_tokens=10,
                                                        structured=choice))[0]
    assert (result.text, result.finish_reason) == ("yes", "stop")
    with pytest.raises(GrammarError, match="not Lark"):
        engine.make_request("Hello", SamplingParams(structured=StructuredOutput("grammar", 'start: "a"')))


def test_logit_bias_forces_and_bans(engine):
    forced = engine.generate(["Hello"], SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                                        logit_bias=((77, 100.0),)))[0]
    assert forced.token_ids == [77] * 6
    plain = engine.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    banned = engine.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0,
                                                        logit_bias=((plain.token_ids[0], -100.0),)))[0]
    assert banned.token_ids[0] != plain.token_ids[0]


def test_min_tokens_holds_back_eos(engine):
    eos = engine.model_config.eos_token_ids[0]
    early = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((eos, 100.0),))
    assert engine.generate(["Hello"], early)[0].token_ids == [eos]
    held = engine.generate(["Hello"], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4,
                                                      logit_bias=((eos, 100.0),)))[0]
    assert len(held.token_ids) == 5 and eos not in held.token_ids[:4] and held.token_ids[4] == eos


def test_a_users_stop_token_the_grammar_takes_as_text_does_not_let_eos_in_mid_output(engine):
    """Mid-output (twenty letters), the user's stop token "e" is text to the grammar: EOS stays
    masked -- the stop token's bit opened every stop token's, and an EOS pushed up by a bias then
    ended the request with an error at its first token."""
    spec = StructuredOutput("regex", "[a-z]{20}", field="structured_outputs")
    letter = engine.tokenizer.encode("e", add_special_tokens=False)[0]
    eos = engine.model_config.eos_token_ids[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, structured=spec, stop_token_ids=(letter,),
                            logit_bias=((eos, 100.0), (letter, -100.0)))
    result = engine.generate(["Hello"], params)[0]
    assert result.finish_reason == "stop" and re.fullmatch("[a-z]{20}", result.text), result
    assert eos not in result.token_ids[:-1]


def test_grammar_mask_applies_before_greedy_argmax():
    from common.engine.sampler import Sampler, SamplingRow

    class OnlyToken:
        def fill_bitmask(self, bitmask, row):
            bitmask[row].zero_()
            bitmask[row, 5 // 32] = 1 << (5 % 32)

    logits = torch.randn(2, 64)
    logits[:, 9] = 50.0
    rows = [SamplingRow(SamplingParams(temperature=0.0), grammar=OnlyToken()), SamplingRow(SamplingParams(temperature=0.0))]
    tokens, _ = Sampler()(logits, rows)
    assert tokens == [5, 9]


class FailsAfter:
    """A real matcher that passes the limits on its work after ``tokens`` tokens (as llguidance's does
    when a grammar's lexer grows past them): from then on it reports an error."""

    def __init__(self, matcher, tokens: int):
        self.matcher, self.left = matcher, tokens

    def __getattr__(self, name):
        return getattr(self.matcher, name)

    def accept(self, token_id: int) -> bool:
        self.left -= 1
        return self.left >= 0 and self.matcher.accept(token_id)

    def error(self) -> str | None:
        return "lexer error: too many expressions constructed" if self.left < 0 else None


@pytest.mark.parametrize("tokens", [0, 2])
def test_a_grammar_that_fails_mid_generation_ends_its_request_with_an_error_naming_why(engine, tokens):
    spec = StructuredOutput("regex", "[a-z ]{1,40}", field="structured_outputs")
    request = engine.make_request("Hello", SamplingParams(max_tokens=20, temperature=1.0, seed=0, structured=spec))
    request.grammar = FailsAfter(request.grammar, tokens)
    engine.scheduler.add_request(request)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request.request_id]
    last = outputs[-1]
    assert (last.finished, last.finish_reason) == (True, "error")
    assert last.error.startswith("structured_outputs: ") and "too many expressions" in last.error
    assert f"past output token {tokens}" in last.error
    assert all(o.error is None for o in outputs[:-1]) and request.num_output_tokens == tokens + 1


def test_a_matcher_in_error_does_not_end_its_request_as_stopped_at_a_stop_token(engine):
    """A mask the backend could not compute allows the stop token only: that is an error, not an
    answer that ends as the grammar allows."""
    spec = StructuredOutput("regex", "[a-z]{3}", field="response_format")
    request = engine.make_request("Hello", SamplingParams(max_tokens=8, structured=spec))
    request.grammar = FailsAfter(request.grammar, -1)  # (failed before its first token)
    eos = next(iter(request.stop_token_ids))
    request.append_token(eos, max_model_len=1024)
    assert request.status.finish_reason == "error" and "past output token 0" in request.error


def test_a_request_that_spends_its_grammars_lexer_leaves_the_next_ones_theirs(directory):
    """Copies of a compiled llguidance grammar share its lexer and the bound on its growth: one
    request driving it past the bound (a branch of five million repeats) must not leave the requests
    after it failing at their first token."""
    from transformers import AutoTokenizer

    from common.engine.structured.llguidance_backend import LLGuidanceBackend

    tokenizer = AutoTokenizer.from_pretrained(directory)
    grammar = LLGuidanceBackend(tokenizer, 512).compile(
        StructuredOutput("regex", "(ab){5}(\u4e2d|cde{5000000})", field="structured_outputs"))

    def follow(text: str) -> str | None:  # the first error on the way, masks included
        matcher, mask = grammar.matcher(), torch.zeros(1, 16, dtype=torch.int32)
        for token in [*tokenizer(text, add_special_tokens=False).input_ids, None]:
            matcher.fill_bitmask(mask, 0)
            if matcher.error() or (token is not None and not matcher.accept(token)):
                return matcher.error() or "refused"
        return None

    assert follow("ababababab\u4e2d") is None
    follow("abababababc")  # (spends the shared lexer, whether or not it sees it itself)
    assert [follow("ababababab\u4e2d") for _ in range(2)] == [None, None] and grammar.renewals >= 1


def test_a_grammar_that_names_a_stop_token_mid_output_ends_its_request_with_an_error(engine):
    """A Lark grammar may name a token by id; a stop token where the output may not end yet is no
    answer that matches the grammar (not a 'stop'), and one where it may is one."""
    eos = 2
    for grammar, reason in ((f'start: "hi" <[{eos}]> "tail"', "error"), ('start: "hi"', "stop")):
        spec = StructuredOutput("grammar", grammar, field="structured_outputs")
        result = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0, structured=spec))[0]
        assert result.finish_reason == reason, (grammar, result)


def test_large_values_in_a_schemas_own_json_are_no_bounds(engine):
    spec = StructuredOutput("json_schema", json.dumps({"type": "integer", "minimum": 0, "maximum": 9,
                                                      "default": {"minimum": 10 ** 30}, "examples": [2 ** 60]}))
    result = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, structured=spec))[0]
    assert result.finish_reason in ("stop", "length")


EAGER_STRUCTURED = """
import json, sys
from common.engine import compute_process
compute_process.configure()
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from common.engine.structured.spec import StructuredOutput
engine = Engine(EngineConfig(model=sys.argv[1], num_blocks=64, block_size=4, compile=False))
spec = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
result = engine.generate(["Hello"], SamplingParams(max_tokens=12, temperature=1.0, seed=1, structured=spec))[0]
print(json.dumps({"text": result.text, "compiler_loaded": "torch._dynamo" in sys.modules}))
"""


def test_a_structured_request_on_an_eager_engine_leaves_torchs_compiler_unloaded(directory):
    """Filling masks must not load torch.compile's machinery (``llguidance.torch`` compiles a
    function at import: seconds of a worker's first structured request, ~7 on a loaded 2-core host)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", EAGER_STRUCTURED, str(directory)], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["text"].startswith("{") and result["compiler_loaded"] is False, result
