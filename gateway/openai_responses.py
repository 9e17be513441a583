"""The OpenAI HTTP API's answers as msgspec structs: responses, stream chunks, the model list, and
their encoding (JSON, Server-Sent Events).  Re-exported by ``gateway.openai_protocol``, which holds
the requests.

Streaming is Server-Sent Events: one ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at
the end.  An error after the stream started is sent as ``data: {"error": {...}}\\n\\n``
(``OpenAIError.to_sse``).
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

import msgspec
from aiohttp import web

FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "Usage":
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens)
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # extension: the stop string (or stop_token_ids token) that ended it


class PromptLogprob(msgspec.Struct):
    """vLLM's shape of a scored prompt token, or of one of its alternatives (``prompt_logprobs``)."""

    logprob: float
    rank: int | None = None  # 1: the most likely token
    decoded_token: str | None = None


# Entry i scores prompt token i (token id -> its score and its alternatives'); the first is null.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ScoredCompletionChoice(CompletionChoice):
    """A completion choice with vLLM's ``prompt_logprobs`` (asked for by that extension)."""

    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class CompletionChunk(CompletionResponse):
    """One SSE event of a streamed completion: the response's shape, with partial ``text``."""


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(msgspec.Struct):
    id: str
    function: ResponseFunction
    type: Literal["function"] = "function"


class ChatResponseMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ResponseToolCall] | msgspec.UnsetType = msgspec.UNSET  # present only with calls
    refusal: None = None  # OpenAI's schema requires the key (null: this model's answers are no refusals)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: Literal["chat.completion"] = "chat.completion"


class ScoredChatCompletionResponse(ChatCompletionResponse):
    """A chat response with vLLM's ``prompt_logprobs`` (the rendered prompt's; asked for by that
    extension)."""

    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A tool call's part of a stream: the first for a call has its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(msgspec.Struct):
    """One SSE event of a streamed chat completion.  With ``include_usage`` the last chunk has
    ``choices == []`` and the usage; earlier ones have ``usage: null``."""

    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None  # extension (vLLM's name)
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


# ---- encoding helpers ---------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_request_id(kind: Literal["cmpl", "chatcmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse_event(obj: msgspec.Struct) -> bytes:
    """``data: {json}\\n\\n``."""
    return b"data: " + _encode(obj) + b"\n\n"


def json_response(obj: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")
