"""Anthropic's Messages API answers: a message whole, or as its stream of events.

A message's ``content`` holds the answer's text as a ``text`` block, then a ``tool_use`` block per
call; its ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (``stop_sequence`` naming
it) or ``tool_use``; a call cut short by ``max_tokens`` has ``input`` {} (its arguments were not yet an
object; streamed, their fragments went out as generated).  The usage's ``input_tokens`` are those computed, ``cache_read_input_tokens``
those found in the prefix cache (their sum is the prompt).

Streamed, every event is an SSE ``event: <type>`` with its JSON: ``message_start`` (the message
without content), each block's ``content_block_start``, its deltas (``text_delta``, or a call's
``input_json_delta`` fragments of its arguments) and ``content_block_stop``, then ``message_delta``
(the stop reason and output tokens) and ``message_stop``; an error after the start is an ``error``
event.  The blocks a stream sends are the ones the whole message holds.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from common.cluster.messages import TokenFrame
from gateway.generation import Generation
from gateway.openai_errors import OpenAIError
from gateway.openai_responses import ChatDelta

# The Messages API's error types, by HTTP status (else api_error).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any  # the arguments' JSON object


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageObject(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    type: str
    message: str
    code: str | None = None  # the OpenAI endpoints' error code, where there is one (beside Anthropic's type)


class ErrorEvent(msgspec.Struct):
    error: ErrorDetail
    type: str = "error"


_encode = msgspec.json.Encoder().encode
_ABORTED = "the generation was aborted"


def tool_input(arguments: str) -> Any:
    """A call's arguments (JSON text) as a tool_use block's ``input``: the object, or {} where the
    text is not one (arguments cut short by max_tokens: streamed, their fragments went out as they were)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def error_body(error: OpenAIError) -> ErrorEvent:
    """An error in the Messages API's shape."""
    return ErrorEvent(ErrorDetail(ERROR_TYPES.get(error.status, "api_error"), error.message, error.code))


def _stop(gen: Generation, made_calls: bool) -> tuple[str, str | None]:
    """The message's ``stop_reason`` and ``stop_sequence``."""
    if gen.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(gen.stop_reason, str):  # a stop string matched (a stop token leaves it None)
        return "stop_sequence", gen.stop_reason
    return "end_turn", None


def _usage(gen: Generation, output_tokens: int | None = None) -> MessageUsage:
    cached = min(gen.cached_tokens, len(gen.prompt_ids))
    return MessageUsage(len(gen.prompt_ids) - cached, len(gen.token_ids) if output_tokens is None else output_tokens,
                        cached)


class MessagesAnswer:
    """One request's answer in the Messages API's shape (one generation)."""

    max_tokens_field = "max_tokens"

    def __init__(self):
        self.response_id = new_message_id()  # the message's id

    def whole(self, gens: list[Generation]) -> MessageObject:
        gen = gens[0]
        if gen.finish_reason == "abort":  # no stop reason tells it: an error, as a stream would end
            raise OpenAIError(500, _ABORTED)
        content, calls = gen.tools.final(gen.text) if gen.tools is not None else (gen.text, [])
        blocks: list = [TextBlock(content or "")] if content or not calls else []
        blocks += [ToolUseBlock(_tool_use_id(), c.name, tool_input(c.arguments)) for c in calls]
        reason, sequence = _stop(gen, bool(calls))
        return MessageObject(id=self.response_id, model=gen.model, content=blocks, stop_reason=reason,
                             stop_sequence=sequence, usage=_usage(gen))

    def stream(self, gen: Generation) -> "MessageStream":
        return MessageStream(self, gen)

    async def keep(self, whole: MessageObject) -> None:
        pass  # messages are not stored


class MessageStream:
    """A message's events as its generation goes (gateway/handlers.py writes them)."""

    def __init__(self, answer: MessagesAnswer, gen: Generation):
        self.answer, self.gen = answer, gen
        self.blocks = 0  # blocks started so far
        self.open: str | None = None  # the open block's type
        self.made_calls = False

    @staticmethod
    def _event(kind: str, payload: dict) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **payload}) + b"\n\n"

    def opening(self) -> bytes:
        gen = self.gen
        message = MessageObject(id=self.answer.response_id, model=gen.model, content=[], stop_reason=None,
                                stop_sequence=None, usage=_usage(gen, output_tokens=0))
        return self._event("message_start", {"message": message})

    def batch(self, gen: Generation, batch: list[tuple[str, TokenFrame]]) -> bytes:
        """The events of a batch of frames (their text deltas and tool calls)."""
        out = []
        last = len(batch) - 1
        for i, (delta, _frame) in enumerate(batch):
            if gen.tools is None:
                if delta:
                    out.append(self._text(delta))
                continue
            ending = i == last and gen.finish_reason is not None
            deltas: list[ChatDelta] = gen.tools.step(delta) + (gen.tools.finish() if ending else [])
            for d in deltas:
                if d.content:
                    out.append(self._text(d.content))
                for call in d.tool_calls or ():
                    if call.id:  # a call's first delta: its name
                        out.append(self._start({"type": "tool_use", "id": _tool_use_id(), "name": call.function.name,
                                                "input": {}}))
                        self.made_calls = True
                    if call.function and call.function.arguments:
                        out.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return b"".join(out)

    async def keep(self) -> None:
        pass  # messages are not stored

    def closing(self) -> bytes:
        """The open block's end, then the stop reason and the end of the message (an aborted
        generation: an ``error`` event)."""
        if self.gen.finish_reason == "abort":
            return self.failure(OpenAIError(500, _ABORTED))
        out = self._stop_block()
        if self.blocks == 0:  # no text, no call: an empty text block, as the whole message has
            out += self._start({"type": "text", "text": ""}) + self._stop_block()
        reason, sequence = _stop(self.gen, self.made_calls)
        return (out + self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                    "usage": {"output_tokens": len(self.gen.token_ids)}})
                + self._event("message_stop", {}))

    def failure(self, error: OpenAIError) -> bytes:
        """An error after the stream started: an ``error`` event (the message ends there)."""
        return self._stop_block() + self._event("error", {"error": error_body(error).error})

    # ---- blocks --------------------------------------------------------------------------------

    def _text(self, text: str) -> bytes:
        out = b"" if self.open == "text" else self._start({"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def _start(self, block: dict) -> bytes:
        out = self._stop_block()
        self.open = block["type"]
        self.blocks += 1
        return out + self._event("content_block_start", {"index": self.blocks - 1, "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return self._event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def _stop_block(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self._event("content_block_stop", {"index": self.blocks - 1})
