"""Grammars whose check recurses once per link: a chain of ``$ref`` definitions, of Lark rules
(tests/engine/test_grammar_depth.py, and the process it compiles them in)."""
from __future__ import annotations

import json


def ref_chain(links: int) -> str:
    """A schema of ``links`` definitions, each an object whose one property is the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(links - 1)}
    defs[f"d{links - 1}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def rule_chain(links: int) -> str:
    """A Lark grammar of ``links`` + 2 rules, each but the last naming the next."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(links)) + f'r{links}: "a"\n'
