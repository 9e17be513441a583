"""The grammar-backend interface, and the choice between the backends.

A backend compiles a ``StructuredOutput`` once (``compile``; slow, cached by ``GrammarCompiler``)
into a ``CompiledGrammar`` from which each request gets its own ``GrammarMatcher`` (cheap). Per
step a matcher fills its row of a token bitmask -- int32 words, bit ``i % 32`` of word ``i // 32``
set where token ``i`` is allowed, the layout llguidance and xgrammar share -- and then consumes
the sampled token.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from common.engine.structured.spec import StructuredOutput

if TYPE_CHECKING:  # the gateway checks grammars without loading torch
    import torch

BACKENDS = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"


class GrammarError(ValueError):
    """A spec the backend cannot compile, or a grammar feature it does not support (a 400: the
    message names the request field)."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (the tokenizer's EOS included where
        the output may end)."""

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; ``False`` (and the matcher unusable) if the grammar forbids it."""

    def probe(self, token_id: int) -> str:
        """What accepting ``token_id`` would do, without advancing: ``"rejected"`` (the grammar
        forbids it), ``"stopped"`` (the grammar is then complete with nothing more allowed) or
        ``"open"``."""

    def is_stopped(self) -> bool:
        """The output must end here: the grammar allows nothing more."""

    def may_end(self) -> bool:
        """The output may end here (the grammar is complete, or may be): a stop token ends it well."""

    def error(self) -> str | None:
        """Why the matcher cannot go on, where it cannot (a limit on the grammar's work passed while
        filling a mask or accepting a token: its mask then allows nothing it means); else ``None``."""


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int  # the model's: the bitmask's width (the tokenizer's vocabulary may be smaller)

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Raises ``GrammarError`` naming ``spec.field``."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
