"""A chat answer with tools: its text turned into content and tool calls, whole or as a stream.

    named      the text is the named function's arguments: the first chunk carries the call's
               index, id and name, every later text delta is an argument fragment
    required   the text is a JSON array of {"name", "parameters"}: each call goes out (id and name,
               then its arguments) as soon as its object is complete; an array cut short by
               max_tokens gives the calls complete in it, then the one it was cut in, where its
               name is complete (its arguments cut short, as a named call's are)
    auto       the text goes out as content up to where a call may begin (``held_from``); the rest
               is parsed when the answer ends, its calls sent then (the first alone where
               ``parallel_tool_calls`` is false); a call the answer was cut short in is sent as
               ``required``'s is, and its markup is never content

Streamed or not, the calls and the content are the same: a stream's argument fragments joined
are the non-streamed ``arguments``.
"""
from __future__ import annotations

import json
import uuid

import msgspec

from gateway.openai_responses import ChatDelta, DeltaFunction, DeltaToolCall, ResponseFunction, ResponseToolCall
from gateway.tool_parsers import ParsedCall, ToolCallParser, cut_call, whole_objects
from gateway.tools_request import ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def complete_calls(text: str, start: int = 0) -> tuple[list[ParsedCall], int]:
    """The ``{"name", "parameters"}`` objects complete in ``text`` from ``start`` on (``required``'s
    array, perhaps cut short), and where the scan stopped."""
    calls = []
    for item, start in whole_objects(text, start):
        if isinstance(item, dict) and "name" in item and "parameters" in item:
            calls.append(ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False,
                                                             separators=(",", ":"))))  # compact, as generated
    return calls, start


class ToolOutput:
    """One answer's tool calls (``plan.parses_calls`` must be true)."""

    def __init__(self, plan: ToolPlan, parser: ToolCallParser):
        self.plan = plan
        self.parser = parser
        self.names = frozenset(t.function.name for t in plan.tools)
        self.text = ""
        self.num_calls = 0  # calls sent so far (a stream)
        self._sent: list[str] = []  # the content sent so far, piece by piece
        self._sent_end = 0  # where in ``text`` the content sent (or skipped: leading whitespace) ends
        self._required_pos = 0  # where the next call's object may start (required)
        self._cut = False  # the answer's last call was cut short (its arguments so far: no JSON)

    # ---- whole ---------------------------------------------------------------------------------

    def final(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The content and calls of the finished ``text``."""
        if self.plan.mode == "named":
            return None, [ParsedCall(self.plan.function, text)]
        if self.plan.mode == "required":  # cut short (max_tokens): the calls complete so far, the cut one
            calls, end = complete_calls(text)
            calls += [cut] if (cut := cut_call(text, end)) else []
            return None, self._noted(calls)  # (cut before a call's name: no call; the array's text is no answer)
        content, calls = self.parser.parse(text, self.names)
        return content, self._noted(self._allowed(calls))

    def _noted(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        self._cut = bool(calls) and calls[-1].cut
        return calls

    def _allowed(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        """``auto``'s calls as the request allows them: the first alone with ``parallel_tool_calls``
        false (the model's text is free, so it may write several; OpenAI's API and vLLM answer one)."""
        return calls if self.plan.parallel else calls[:1]

    def finish_reason(self, called: bool, finish: str | None, stop_reason: str | int | None = None) -> str | None:
        """``tool_calls`` where the answer ended (``stop``) in calls of its choosing (``auto``,
        ``required``); a named function's call ends ``stop``, as in OpenAI's API and vLLM, and so
        does ``required``'s array cut by a stop string or token (``stop_reason``): its last call is
        not whole, and a client must not take it for one -- as ``auto``'s cut in a call."""
        if self.plan.mode == "named" or ((self.plan.mode == "required" or self._cut) and stop_reason is not None):
            return finish
        return "tool_calls" if called and finish == "stop" else finish

    def message_calls(self, calls: list[ParsedCall]) -> list[ResponseToolCall] | msgspec.UnsetType:
        return [ResponseToolCall(new_call_id(), ResponseFunction(c.name, c.arguments)) for c in calls] or msgspec.UNSET

    # ---- streamed ------------------------------------------------------------------------------

    def step(self, delta: str) -> list[ChatDelta]:
        """The deltas to send for ``delta``, the next piece of the text."""
        self.text += delta
        if self.plan.mode == "named":
            out = [] if self.num_calls else [self._call_start(self.plan.function)]
            self.num_calls = 1
            if delta:
                out.append(self._arguments(0, delta))
            return out
        if self.plan.mode == "required":  # a call can only complete with a closing brace
            return self._complete_required_calls() if "}" in delta else []
        return self._content_until(self.parser.held_from(self.text, self._sent_end))

    def finish(self) -> list[ChatDelta]:
        """The deltas still to send once the text is complete."""
        if self.plan.mode == "named":
            return [] if self.num_calls else [self._call_start(self.plan.function)]
        if self.plan.mode == "required":
            out = self._complete_required_calls()
            if cut := cut_call(self.text, self._required_pos):  # cut short in a call (before its name: none)
                out += self._send_call(cut)
            self._cut = cut is not None
            return out
        content, calls = self.parser.parse(self.text, self.names)
        calls = self._noted(self._allowed(calls))
        out = []
        sent = "".join(self._sent)
        if content and content.startswith(sent) and len(content) > len(sent):  # text after the calls
            out.append(ChatDelta(content=content[len(sent):]))
        for call in calls:
            out += self._send_call(call)
        return out

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0

    def _content_until(self, end: int) -> list[ChatDelta]:
        """Send ``text[..end]`` as content, past what was sent; leading whitespace is skipped and
        trailing whitespace held back (the whole answer's content is stripped).  Each call looks at
        the new text only."""
        segment = self.text[self._sent_end:end]
        if not self._sent:
            kept = segment.lstrip()
            self._sent_end += len(segment) - len(kept)
            segment = kept
        piece = segment.rstrip()
        if not piece:
            return []
        self._sent.append(piece)
        self._sent_end += len(piece)
        return [ChatDelta(content=piece)]

    def _complete_required_calls(self) -> list[ChatDelta]:
        calls, self._required_pos = complete_calls(self.text, self._required_pos)
        return [delta for call in calls for delta in self._send_call(call)]

    def _send_call(self, call: ParsedCall) -> list[ChatDelta]:
        index = self.num_calls
        self.num_calls += 1
        return [self._call_start(call.name, index), self._arguments(index, call.arguments)]

    @staticmethod
    def _call_start(name: str, index: int = 0) -> ChatDelta:
        return ChatDelta(tool_calls=[DeltaToolCall(index, id=new_call_id(), type="function",
                                                   function=DeltaFunction(name=name, arguments=""))])

    @staticmethod
    def _arguments(index: int, fragment: str) -> ChatDelta:
        return ChatDelta(tool_calls=[DeltaToolCall(index, function=DeltaFunction(arguments=fragment))])
