"""The llguidance backend (the default): JSON schemas, regexes, choices, Lark and GBNF grammars.

Compiling builds one matcher per spec (checking the grammar and its resource limits); each request
gets a ``deep_copy`` of it.  JSON is generated compact (no free whitespace): a model cannot pad an
answer with newlines until it runs out of tokens, and the output is what ``json.dumps`` would give.
"""
from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any, Callable

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import gbnf_to_lark

from common.engine.structured.backend import GrammarError
from common.engine.structured.spec import StructuredOutput, is_gbnf

# Bounds on the work one grammar may cost, at compile and per step (llguidance's own defaults are
# larger: a hostile schema must not hold a compile thread or a step for long).
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000)
JSON_DEFAULTS = {"whitespace_flexible": False}
# A Lark grammar's rules, at most: llguidance recurses once per link of a chain of rules when it
# checks a grammar (a chain of 100 000 overflows even a compile thread's deep stack: compiler.py).
# Real grammars define hundreds (a whole SQL dialect: ~500).
MAX_GRAMMAR_RULES = 5000
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*:", re.MULTILINE)

if TYPE_CHECKING:  # masks are filled on workers; the gateway only compiles, without loading torch
    import torch


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    @staticmethod
    def fill_many(matchers: "list[LLGuidanceMatcher]", bitmask: torch.Tensor) -> None:
        """Row ``i``: ``matchers[i]``'s mask; the rows computed in parallel (llguidance's threads).
        (Called as ``llguidance.torch`` would, whose import compiles a function of its own with
        torch.compile: seconds of loading torch's compiler into a worker that runs eagerly.)"""
        import torch  # (loaded on every worker that fills masks; the gateway only compiles)

        rows, words = bitmask.shape
        if not (bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous() and len(matchers) <= rows):
            raise ValueError(f"a bitmask for {len(matchers)} matchers must be a contiguous CPU int32 tensor of at "
                             f"least as many rows, not {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        _executor().unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                            words * 4, rows)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id))

    def probe(self, token_id: int) -> str:
        copy = self._m.deep_copy()
        if not copy.consume_token(token_id):
            return "rejected"
        return "stopped" if copy.is_stopped() else "open"

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def may_end(self) -> bool:
        return self._m.is_accepting()

    def error(self) -> str | None:
        return _first_line(self._m.get_error()) if self._m.is_error() else None


class LLGuidanceGrammar:
    """A compiled grammar: each request's matcher is a copy of one prototype.  The copies share the
    prototype's lexer, and with it the bound on the lexer's growth: a request that passed it leaves
    every later copy failing at its first token.  So a new copy whose first mask fails renews the
    grammar -- the prototype built again -- and is made again from it: one request's failure stays
    its own."""

    def __init__(self, build: Callable[[], llguidance.LLMatcher]):
        self._build = build
        self.prototype = build()
        self.renewals = 0

    def matcher(self) -> LLGuidanceMatcher:
        copy = self.prototype.deep_copy()
        copy.compute_bitmask()  # (cheap: the prototype's lexer holds its first step)
        if copy.is_error():  # (renewed: built again)
            self.prototype = self._build()
            self.renewals += 1
            copy = self.prototype.deep_copy()
        return LLGuidanceMatcher(copy)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._limits = llguidance.LLParserLimits(**LIMITS)

    def compile(self, spec: StructuredOutput) -> LLGuidanceGrammar:
        grammar = self._grammar(spec)
        compiled = LLGuidanceGrammar(
            lambda: llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits))
        if compiled.prototype.is_error():
            raise GrammarError(f"{spec.field}: unsupported or invalid {_what(spec)}: {compiled.prototype.get_error()}")
        failure = _first_step_failure(compiled.prototype)
        if failure is not None:
            raise GrammarError(f"{spec.field}: the {_what(spec)} goes past this server's bounds on a grammar's work "
                               f"at its first token ({failure})")
        return compiled

    def _grammar(self, spec: StructuredOutput) -> str:
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.schema()
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
            if spec.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.value)
            if spec.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choices())
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            text = gbnf_to_lark(spec.value) if is_gbnf(spec.value) else spec.value
            rules = len(_RULE_DEFINITION.findall(text))
            if rules > MAX_GRAMMAR_RULES:
                raise GrammarError(f"{spec.field}: the grammar defines {rules} rules; at most {MAX_GRAMMAR_RULES} "
                                   "are served")
            return llguidance.LLMatcher.grammar_from_lark(text)
        except GrammarError:
            raise
        except Exception as exc:  # ValueError from the spec; llguidance's own errors
            message = str(exc)
            raise GrammarError(message if message.startswith(spec.field) else
                               f"{spec.field}: invalid {_what(spec)}: {message}") from None


def _first_line(message: str) -> str:
    """llguidance's error, without the parser state it dumps after the first line."""
    return message.strip().split("\n", 1)[0][:500]


def _first_step_failure(prototype: llguidance.LLMatcher) -> str | None:
    """Why the grammar fails at its first token -- its first mask, or the first token that mask
    allows past the limits (a repeat count in the millions builds its lexer only then) --, on a
    copy; ``None`` where that step works.  Most grammars too costly for the limits fail here, at
    compile (a 400 before any worker sees them); one that fails later ends its request with an
    error naming why (``common.engine.request``)."""
    matcher = prototype.deep_copy()
    mask = matcher.compute_bitmask()
    if matcher.is_error():
        return _first_line(matcher.get_error())
    allowed = next((i * 8 + bit for i, byte in enumerate(mask) if byte for bit in range(8) if byte >> bit & 1), None)
    if allowed is not None and not matcher.consume_token(allowed) and matcher.is_error():
        return _first_line(matcher.get_error())
    return None


def _what(spec: StructuredOutput) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]
