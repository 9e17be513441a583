"""The xgrammar backend (optional: ``--structured-output-backend xgrammar``).

JSON schemas, regexes, choices and GBNF/EBNF grammars; Lark grammars are llguidance's dialect and
refused here with a 400.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar

from common.engine.structured.backend import GrammarError
from common.engine.structured.spec import StructuredOutput, is_gbnf


class XGrammarMatcher:
    def __init__(self, matcher: "xgrammar.GrammarMatcher"):
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def probe(self, token_id: int) -> str:
        if not self._m.accept_token(token_id):
            return "rejected"
        stopped = self._m.is_terminated()
        self._m.rollback(1)
        return "stopped" if stopped else "open"

    def is_stopped(self) -> bool:
        return self._m.is_terminated()

    def may_end(self) -> bool:
        return self._m.is_completed() or self._m.is_terminated()

    def error(self) -> str | None:
        return None  # (xgrammar's matchers have no error state: a token it forbids is refused)


class XGrammarGrammar:
    def __init__(self, compiled: "xgrammar.CompiledGrammar"):
        self._compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutput) -> XGrammarGrammar:
        try:
            if spec.kind in ("json_schema", "json_object"):
                compiled = self._compiler.compile_json_schema(json.dumps(spec.schema()), any_whitespace=False)
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choices())
                compiled = self._compiler.compile_grammar(f"root ::= {alternatives}")
            elif is_gbnf(spec.value):
                compiled = self._compiler.compile_grammar(spec.value)
            else:
                raise GrammarError(f"{spec.field}: the xgrammar backend reads GBNF/EBNF grammars (rules with "
                                   "'::='), not Lark; use the llguidance backend for Lark")
        except GrammarError:
            raise
        except Exception as exc:
            message = str(exc)
            raise GrammarError(message if message.startswith(spec.field) else
                               f"{spec.field}: unsupported or invalid {spec.kind}: {message}") from None
        return XGrammarGrammar(compiled)
