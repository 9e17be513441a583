"""What a request asks its output to match, as it travels to the workers (inside ``SamplingParams``)."""
from __future__ import annotations

import json
from typing import Literal

from common.engine.structs import Struct

# A schema or grammar above this is refused before any backend sees it (the request body is
# bounded too; this bounds what a worker compiles and caches per entry).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class StructuredOutput(Struct, forbid_unknown_fields=True, frozen=True):
    """One constraint on a request's output.

    ``kind``        ``value``
    json_schema     the JSON schema, as JSON text
    json_object     ignored ("" by convention): any JSON object
    regex           the regular expression the whole output matches
    choice          a JSON array of the strings the output may be (exactly one of them)
    grammar         a Lark grammar (llguidance's dialect) or a GBNF/EBNF grammar (``::=`` rules)

    ``field`` is the request field it came from (``response_format``, ``structured_outputs``,
    ``tools``), so an error names what the client sent.
    """

    kind: StructuredKind
    value: str = ""
    field: str = "response_format"

    def __post_init__(self) -> None:
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{self.field}: the {self.kind} is {len(self.value)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are allowed")
        if len(self.field) > 64:
            raise ValueError("structured output field name too long")

    @property
    def cache_key(self) -> tuple[str, str, str]:
        """The compiler's cache key (the field too: a rejection's message names it)."""
        return self.kind, self.value, self.field

    def choices(self) -> list[str]:
        """The strings of a ``choice`` spec; ``ValueError`` when it is not a non-empty list of them."""
        try:
            values = json.loads(self.value)
        except (ValueError, RecursionError):
            raise ValueError(f"{self.field}: choice must be a JSON array of strings") from None
        if (not isinstance(values, list) or not values or len(values) > MAX_CHOICES
                or not all(isinstance(v, str) and v for v in values)):
            raise ValueError(f"{self.field}: choice must be 1-{MAX_CHOICES} non-empty strings")
        return values

    def schema(self) -> dict:
        """The JSON schema of a ``json_schema`` spec (``{"type": "object"}`` for ``json_object``)."""
        if self.kind == "json_object":
            return {"type": "object"}
        try:
            schema = json.loads(self.value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{self.field}: the JSON schema is not valid JSON (or nested too deeply): {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{self.field}: a JSON schema must be an object (or true/false)")
        _check_bounds(schema, self.field)
        return schema


# Numbers a schema may bound exactly: the backends compare bounds as doubles (beyond 2^53 an integer
# bound is rounded, and what they let through breaks the schema).
MAX_EXACT_BOUND = 2 ** 53
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_VALUES = ("const", "enum", "default", "examples")  # JSON values, not schemas: not looked into


def _check_bounds(schema, field: str) -> None:
    """A ``ValueError`` naming ``field`` for a numeric bound past ``MAX_EXACT_BOUND`` anywhere in ``schema``
    (the decoder bounded its depth)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if (key in _BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool)
                        and not -MAX_EXACT_BOUND <= value <= MAX_EXACT_BOUND):
                    raise ValueError(f"{field}: the JSON schema's {key} {value:.6g} is beyond +-2^53, the numbers "
                                     "its bounds can be held to exactly")
                if key not in _VALUES:
                    pending.append(value)


def is_gbnf(grammar: str) -> bool:
    """A GBNF/EBNF grammar (``rule ::= ...``) rather than Lark (``rule: ...``)."""
    return "::=" in grammar
