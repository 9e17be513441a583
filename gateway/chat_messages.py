"""A chat request's messages, as a client sends them back: its own turns, and the answers it got --
with the fields the API answered them with, and those the official clients add to what they return
(``messages.append(choice.message)`` sends them all): an answer's refusal (its text where
``content`` is null) and citations; ``parse()``'s ``parsed`` and ``parsed_arguments``; a streamed
call's ``index``; vLLM's ``reasoning_content``.  None of those is prompt text but the refusal.
Encoded (a stored response's history) without the fields left at their defaults: a reader that
predates a field still reads what it wrote.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.tools_request import MAX_TOOLS, FunctionName

MAX_PARTS_PER_MESSAGE = 64  # content parts of one message (and of all of a request's: openai_protocol)


class ContentPart(msgspec.Struct, kw_only=True):
    # Unknown fields allowed here only so that an image part gets "text only" rather than
    # "unknown field image_url"; the type is checked in validation.
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part (its text)


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: FunctionName
    arguments: str  # JSON text, as the assistant produced it
    parsed_arguments: Any = None  # the client's parse of them (``parse()``): not read


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: Annotated[str, msgspec.Meta(max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None  # its place in a streamed answer (the client's accumulator keeps it): not read


def join_parts(texts) -> str:
    """A message's text parts as one text: a line apart, as vLLM (and its chat path's templates) read
    them -- "Say hi" and "please" are not "Say hiplease"."""
    return "\n".join(texts)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_PARTS_PER_MESSAGE)] | None = None
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    tool_calls: Annotated[list[MessageToolCall], msgspec.Meta(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None  # tool
    # An answer sent back as it came (the module docstring); audio and a legacy function call are never held.
    refusal: str | None = None
    annotations: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_PARTS_PER_MESSAGE)] | None = None
    audio: None = None
    function_call: None = None
    parsed: Any = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return join_parts((part.refusal if part.type == "refusal" else part.text) or "" for part in self.content)
