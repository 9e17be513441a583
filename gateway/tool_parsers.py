"""Tool calls read from a model's text (``tool_choice: auto``), one parser per output format.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...   Qwen 2.5/3, Hermes
    llama3_json  <|python_tag|>{"name": "f", "parameters": {...}}; {...}      Llama 3.1-3.3
    json         {"name": "f", "arguments": {...}}  or  [{...}, ...]          any template

``parse(text)`` gives the content (the text outside the calls, stripped; None when empty) and
the calls; a call naming a function that is not among the request's tools is left as text.
``held_from(text)`` tells a stream how much of the text so far may go out as content now: the
rest may still become a call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

PARSERS = ("hermes", "llama3_json", "json")
_NOT_SPACE = re.compile(r"\S")
DEFAULT_PARSER = "hermes"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text; with ``cut``, its beginning: the output was cut short in it
    cut: bool = field(default=False, compare=False)


_CALL_OPENING = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"(?:parameters|arguments)"\s*:\s*)?')


def whole_objects(text: str, start: int = 0):
    """``(value, end)`` of each JSON object whole in ``text`` from ``start`` on, in order, up to the
    first that is not (an output cut short: it begins at the next ``{`` after the last ``end``)."""
    decoder = json.JSONDecoder()
    while (begin := text.find("{", start)) >= 0:
        try:
            value, start = decoder.raw_decode(text, begin)
        except (ValueError, RecursionError):  # incomplete (or nested past Python's parser)
            return
        yield value, start


def cut_call(text: str, start: int = 0) -> ParsedCall | None:
    """The call an output was cut short in (max_tokens, a stop string), from ``start`` on: its name,
    where complete, and its arguments (``parameters`` or ``arguments``) so far; ``None`` where its
    name is not complete."""
    opening = _CALL_OPENING.search(text, start)
    try:
        name = json.loads(opening.group(1)) if opening else None
    except ValueError:  # (an escape JSON does not know)
        return None
    if not isinstance(name, str):
        return None
    return ParsedCall(name, text[opening.end():].rstrip() if opening.group(2) else "", cut=True)


class ToolCallParser(Protocol):
    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        """The content and the calls of a finished output."""

    def held_from(self, text: str, start: int = 0) -> int:
        """Where the part of an unfinished output that may still be (or be in) a call begins;
        ``start``: no call begins before it (what a stream has sent already)."""


def _call(value, names: frozenset[str]) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):
            return None
        return ParsedCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text.strip() or None


def _partial_tag_at_end(text: str, tag: str) -> int:
    """Where a prefix of ``tag`` that ``text`` ends with begins (``len(text)`` if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return len(text) - size
    return len(text)


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        calls, outside, pos = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._read(m.group(1), names)
            outside.append(text[pos:m.start()] if call else text[pos:m.end()])
            if call:
                calls.append(call)
            pos = m.end()
        rest = text[pos:]
        start = rest.find(self.OPEN)
        if start >= 0:  # an unclosed last call: the model stopped, or was cut short, before the closing tag
            body = rest[start + len(self.OPEN):]
            call = self._read(body, names) or cut_call(body)
            if call is None or call.name in names:  # (cut before its name: its markup is no content either)
                calls += [call] if call else []
                rest = rest[:start]  # (an unknown function's stays text, as a closed call's does)
        outside.append(rest)
        return _content("".join(outside)), calls

    @staticmethod
    def _read(body: str, names: frozenset[str]) -> ParsedCall | None:
        try:
            return _call(json.loads(body), names)
        except (ValueError, RecursionError):  # a model's text nested past Python's parser is no call
            return None

    def held_from(self, text: str, start: int = 0) -> int:
        found = text.find(self.OPEN, start)
        return found if found >= 0 else max(start, _partial_tag_at_end(text, self.OPEN))


class JsonParser:
    """A JSON object or array of calls, or several separated by ``;`` (after an optional prefix)."""

    prefix = ""

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if self.prefix and body.startswith(self.prefix):
            body = body[len(self.prefix):].lstrip()
        if not body.startswith(("{", "[")):
            return _content(text), []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        try:
            while pos < len(body):
                value, pos = decoder.raw_decode(body, pos)
                for item in value if isinstance(value, list) else [value]:
                    call = _call(item, names)
                    if call is None:
                        return _content(text), []
                    calls.append(call)
                while pos < len(body) and body[pos] in " \t\r\n;,":
                    pos += 1
        except (ValueError, RecursionError):  # cut short (max_tokens, a stop string), or no JSON
            calls = _calls_so_far(body, names)
        return (None, calls) if calls else (_content(text), [])

    def held_from(self, text: str, start: int = 0) -> int:
        first = _NOT_SPACE.search(text)  # the output's first character decides: a call, or text
        if first is None:
            return start
        head = text[first.start():first.start() + max(len(self.prefix), 1)]
        if head.startswith(("{", "[")) or (self.prefix and (head.startswith(self.prefix)
                                                            or self.prefix.startswith(head))):
            return first.start()
        return len(text)


def _calls_so_far(body: str, names: frozenset[str]) -> list[ParsedCall]:
    """The calls of a body that is no whole JSON: each object whole in it a call, then the one it was
    cut short in (where its name is whole); none where an object in it is no call (text)."""
    calls, end = [], 0
    for item, end in whole_objects(body):
        if (call := _call(item, names)) is None:
            return []
        calls.append(call)
    begin = body.find("{", end)  # the object it was cut short in: a call's opening, right there
    cut = cut_call(body, begin) if begin >= 0 and _CALL_OPENING.match(body, begin) else None
    if cut is not None and cut.name not in names:
        return []  # an unknown function's: text, as a whole one's is
    return calls + [cut] if cut is not None else calls


class Llama3JsonParser(JsonParser):
    prefix = "<|python_tag|>"


def make_parser(name: str) -> ToolCallParser:
    parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "json": JsonParser}
    if name not in parsers:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(PARSERS)}")
    return parsers[name]()
