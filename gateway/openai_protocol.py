"""The OpenAI HTTP API's requests as msgspec structs, their decoding and validation; the answers
(responses, stream chunks, SSE) are in ``gateway/openai_responses.py`` and re-exported here.

Requests are decoded strictly: an unknown field is a 400 naming it (a silently ignored
``logit_bias`` or ``tools`` would produce an answer the client did not ask for), and every range
error names the parameter.  Only the JSON types are read as leniently as OpenAI's and vLLM's
servers do (16.0 is the integer 16; "16" and "true" are read as 16 and true).  ``gateway/openapi.py``
describes the same rules as an OpenAPI document.  ``parse_completion_request`` / ``parse_chat_request`` turn a raw body
into a validated struct or raise ``OpenAIError``; ``req.sampling()`` gives the normalised knobs the
engine needs.

No field makes the gateway build an object per element before its bound is checked: the fields a
4 MiB body could fill with hundreds of thousands of elements -- ``prompt``, ``stop``, ``messages``
and their content parts, ``logit_bias`` -- are first decoded as ``msgspec.Raw`` (JSON checked, no
objects), then counted or decoded within their bounds (``gateway/json_bounds.py``,
``gateway/prompt_input.py``); ``logit_bias`` is refused by size beyond its 300 entries, ``metadata``
beyond ``MAX_METADATA_BYTES``, ``chat_template_kwargs`` beyond its own bound
(``gateway/template_kwargs.py``), and the structured-output fields beyond ``MAX_GRAMMAR_CHARS``
(``gateway/structured_request.py``).

Temperatures below 1e-5 mean greedy (as in vLLM); a ``top_k`` at or above the vocabulary size is
clamped to "no top-k" (as in vLLM).

Supported, beyond plain OpenAI (vLLM's extensions): ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``structured_outputs``, ``cache_salt`` (requests
share prefix-cache blocks only with requests of the same salt), the chat template's
``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message``, and
``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits).  The README's field table says
which OpenAI fields are honoured and which are refused with a 400 naming them.
"""
from __future__ import annotations

import functools
import itertools
import json
import re
from typing import Annotated, Any, ClassVar

import msgspec

from common.engine.kv.prefix_hash import MAX_CACHE_SALT_LEN
from common.engine.sampling_params import (
    INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOKEN_ID,
)
from common.engine.structured.spec import StructuredOutput
from common.cluster.messages import MAX_PROMPT_TOKENS
from gateway.openai_errors import (  # noqa: F401 (API)
    ErrorBody, ErrorResponse, OpenAIError, error_response, from_msgspec, invalid, split_error_path,
)
from gateway.json_bounds import bounded_list, items, too_deep_field
from gateway.openai_responses import (  # noqa: F401 (API: the answers, with the requests)
    SSE_DONE, SSE_HEADERS, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionChunk, CompletionLogprobs,
    CompletionResponse, FinishReason, ModelCard, ModelList, PromptTokensDetails, TopLogprob, Usage, json_response,
    new_request_id, now, sse_event,
)
from gateway.prompt_input import MAX_REQUEST_CHOICES, decode_prompt
from gateway.request_extensions import RequestExtensions, check_extensions, given
from gateway.sampling_options import SamplingOptions, sampling_options
from gateway.template_kwargs import read_template_kwargs
from gateway.structured_request import read_response_format, read_structured_outputs
from gateway.chat_messages import (  # noqa: F401 (API: the messages, with the requests)
    MAX_PARTS_PER_MESSAGE, CalledFunction, ChatMessage, ContentPart, MessageToolCall, join_parts,
)
from gateway.tools_request import Tool, ToolChoice, ToolPlan, plan_tools, read_tools

MAX_N = 16  # choices per prompt (each is a sequence the workers generate); with a batch: MAX_REQUEST_CHOICES
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096  # ... and of all the messages of a request together

# ---- requests -----------------------------------------------------------------------------------

MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKEN_ID)]
# A completion's: 0 with echo answers the prompt alone (scoring it, with logprobs: OpenAI's legacy API, vLLM).
CompletionMaxTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, msgspec.Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
UserId = Annotated[str, msgspec.Meta(max_length=256)]
StopTokenIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]],
                         msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_LEN)]
# OpenAI's: accepted and not used (at most 16 string pairs, as OpenAI bounds them; read by ``read_metadata``)
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]
MAX_METADATA_BYTES = 128 * 1024  # its JSON: 16 pairs of 64 + 512 characters, each escaped to at most 12 bytes


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # with include_usage: every chunk carries its usage (vLLM's)


class _Common(RequestExtensions, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by both endpoints.  ``None`` means "the default"; a field of ``NULL_IS_DEFAULT``
    sent as null reads as its default (OpenAI's schema lets a client send null for it: ``decode_body``)."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("stream", "ignore_eos", "n", "store", "min_tokens")

    model: ModelName
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # Extension.  0 or -1 also mean "off" (what vLLM clients send); a value at or above the
    # vocabulary size keeps every token, so the handler clamps it to "off" (as vLLM does).
    top_k: int | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = 1
    user: UserId | None = None
    safety_identifier: UserId | None = None  # OpenAI's: accepted, not used
    store: bool | None = False  # OpenAI's stored completions: only false (there is no store)
    metadata: Metadata | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # extension
    min_p: MinP | None = None  # extension
    # token id -> bias in [-100, 100] (read from the body by ``_read_logit_bias``)
    logit_bias: dict[int, float] | None = None
    # Read from the body by gateway/structured_request.py; at most one of the two is set.
    response_format: StructuredOutput | None = None
    structured_outputs: StructuredOutput | None = None  # extension (vLLM's)
    min_tokens: MinTokens | None = 0  # extension (vLLM's)
    stop_token_ids: StopTokenIds | None = None  # extension (vLLM's)
    # Extension (vLLM's): the prompt's blocks are cached apart from requests with another salt.
    cache_salt: CacheSalt | None = None
    # Extension (vLLM's): each prompt token's logprob, rank and top alternatives, in the answer's
    # ``prompt_logprobs`` (a completion choice's; a chat response's); not streamed.
    prompt_logprobs: Logprobs | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``.  ``prompt`` holds the request's prompts -- one, or a batch -- each a
    string or a list of token ids (decoded from the body's ``prompt`` by gateway/prompt_input.py,
    which the API takes as a string, token ids, or a list of either)."""

    # max_tokens: null is OpenAI's default, 16 (a chat's default, null, is no bound but the context)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = _Common.NULL_IS_DEFAULT + ("echo", "max_tokens")

    prompt: list[str | list[int]]
    max_tokens: CompletionMaxTokens | None = 16
    logprobs: Logprobs | None = None
    echo: bool | None = False
    # Candidates per prompt, the n with the highest cumulative logprob answered (all of them counted
    # in the usage, as OpenAI bills them); not streamed.
    best_of: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    def sampling(self) -> SamplingOptions:
        return sampling_options(self, self.max_tokens, self.logprobs)

    def output_bound_field(self) -> str:
        """The field that bounds the answer's tokens, as a refusal of that bound names it."""
        return "max_tokens"


class _CompletionBody(CompletionRequest):
    """What the body decodes to: the fields a body can fill with hundreds of thousands of elements
    as their JSON (checked as JSON, no Python objects), for bounded decoding (``decode_prompt``,
    ``_common_fields``)."""

    prompt: msgspec.Raw
    stop: msgspec.Raw = msgspec.Raw()  # empty: not sent (msgspec.Raw | None is not a union msgspec decodes)
    metadata: msgspec.Raw = msgspec.Raw()
    logit_bias: msgspec.Raw = msgspec.Raw()
    response_format: msgspec.Raw = msgspec.Raw()
    structured_outputs: msgspec.Raw = msgspec.Raw()


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``.  ``max_tokens`` is the deprecated alias of
    ``max_completion_tokens``."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = _Common.NULL_IS_DEFAULT + (
        "logprobs", "parallel_tool_calls", "add_generation_prompt", "continue_final_message")

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    tools: tuple[Tool, ...] = ()  # read from the body by gateway/tools_request.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # Extensions (vLLM's): how the chat template renders the messages.  ``continue_final_message``
    # leaves the last message open for the answer to go on from it (the generation prompt is then
    # left out, whatever ``add_generation_prompt`` says); ``chat_template_kwargs`` are the template's
    # own variables (read by ``read_template_kwargs``).
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None  # vLLM's: only false (``check_extensions``)

    def sampling(self) -> SamplingOptions:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return sampling_options(self, self.max_completion_tokens or self.max_tokens, logprobs)

    def output_bound_field(self) -> str:
        """The field that bounds the answer's tokens as the client sent it (``max_tokens`` alone: that
        alias), as a refusal of that bound names it."""
        return "max_tokens" if self.max_completion_tokens is None and self.max_tokens is not None \
            else "max_completion_tokens"

    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_messages(self) -> list[dict]:
        """Messages as plain dicts with text content, ready for a chat template: an assistant's
        tool calls with their arguments as objects (as templates read them), a tool result with
        its call's id."""
        out = []
        for m in self.messages:
            d: dict = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


class _MessageBody(ChatMessage):
    """A message as decoded: its content's JSON, for bounded decoding (``_decode_messages``)."""

    content: msgspec.Raw = msgspec.Raw()


def _arguments(text: str):
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON (or nested past Python's parser): the text as it is
        return text
    return value if isinstance(value, dict) else text


class _ChatBody(ChatCompletionRequest):
    """What a chat body decodes to (see ``_CompletionBody``)."""

    messages: msgspec.Raw
    tools: msgspec.Raw = msgspec.Raw()
    stop: msgspec.Raw = msgspec.Raw()
    metadata: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    logit_bias: msgspec.Raw = msgspec.Raw()
    response_format: msgspec.Raw = msgspec.Raw()
    structured_outputs: msgspec.Raw = msgspec.Raw()


def validate_common(req: _Common) -> None:
    if req.top_k is not None and req.top_k < -1:
        raise invalid(f"top_k must be >= 1 (or 0/-1/null to disable), got {req.top_k}", "top_k")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
        raise invalid(f"seed must fit in a signed 64-bit integer, got {req.seed}", "seed")
    if req.store:
        raise invalid("store: stored completions are not supported", "store", "unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise invalid("prompt_logprobs are not streamed (as in vLLM): ask without stream, or use echo with logprobs "
                      "on /v1/completions", "prompt_logprobs", "prompt_logprobs_not_streamed")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_LEN:
            raise invalid(f"each stop string must be 1-{MAX_STOP_LEN} characters, got {len(s)}", "stop")


def decode_body(decoder: msgspec.json.Decoder, body: bytes):
    """The body decoded; its ``NULL_IS_DEFAULT`` fields sent as null read as their defaults."""
    try:
        decoded = decoder.decode(body)
        for name in getattr(decoded, "NULL_IS_DEFAULT", ()):
            if getattr(decoded, name) is None:
                setattr(decoded, name, _default(type(decoded), name))
        return decoded
    except msgspec.MsgspecError as exc:
        raise from_msgspec(exc, body=body) from None
    except RecursionError:  # msgspec's guard on nesting (the interpreter's recursion limit)
        field = too_deep_field(body)
        raise invalid(f"Request body is nested too deeply{f' in {field!r}' if field else ''}: JSON arrays and "
                      "objects nested hundreds of levels deep (no field of this API nests more than a few)",
                      field, "json_too_deep") from None


def decode_at(decoder: msgspec.json.Decoder, raw: msgspec.Raw, at: str):
    """A part of the request kept as ``msgspec.Raw`` decoded on its own; errors name ``at``."""
    try:
        return decoder.decode(raw)
    except msgspec.MsgspecError as exc:
        raise from_msgspec(exc, at) from None


def _common_fields(body: _Common, cls: type[_Common]) -> dict:
    """The fields of ``cls`` from a decoded body, ``stop`` decoded within its bounds and
    ``logit_bias`` checked unread."""
    fields = {name: getattr(body, name) for name in cls.__struct_fields__}
    fields["stop"] = read_stop(body.stop) if given(body.stop) else None
    fields["metadata"] = read_metadata(body.metadata) if given(body.metadata) else None
    fields["logit_bias"] = _read_logit_bias(body.logit_bias) if given(body.logit_bias) else None
    fields["response_format"] = (read_response_format(body.response_format, from_msgspec)
                                 if given(body.response_format) else None)
    fields["structured_outputs"] = (read_structured_outputs(body.structured_outputs, from_msgspec)
                                    if given(body.structured_outputs) else None)
    if fields["response_format"] is not None and fields["structured_outputs"] is not None:
        raise invalid("response_format and structured_outputs both constrain the output; send one",
                      "structured_outputs")
    return fields


def read_stop(raw: msgspec.Raw, field: str = "stop") -> str | list[str]:
    """``stop`` (named ``field`` in errors): a string or a list of at most ``MAX_STOP_STRINGS`` (refused at
    the one past it)."""
    stop = decode_at(_stop_decoder, raw, field)
    return stop if isinstance(stop, str) else items(stop)


def read_metadata(raw: msgspec.Raw) -> dict[str, str]:
    """``metadata``, refused by size before its pairs are read (a dict's bound is checked after)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise invalid(f"metadata is {len(raw)} bytes of JSON; at most {MAX_METADATA_BYTES} are allowed (16 pairs)",
                      "metadata")
    return decode_at(_metadata_decoder, raw, "metadata")


_COLON_RE = re.compile(b":")


def _read_logit_bias(raw: msgspec.Raw) -> dict[int, float]:
    """``{"token id": bias}``: at most ``MAX_LOGIT_BIAS`` entries (refused before they are read:
    each has a colon, and a key -- a token id -- holds none), ids as decimal strings, biases in
    [-100, 100]."""
    if next(itertools.islice(_COLON_RE.finditer(raw), MAX_LOGIT_BIAS, None), None) is not None:
        raise invalid(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries (keyed by token id)", "logit_bias")
    bias = decode_at(_logit_bias_decoder, raw, "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit() or int(key) > MAX_TOKEN_ID:
            raise invalid(f"logit_bias keys must be token ids (decimal strings), got {key!r}", "logit_bias")
        if not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
            raise invalid(f"logit_bias values must be in [-100, 100], got {value} for token {key}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _decode_messages(raw: msgspec.Raw) -> list[ChatMessage]:
    """The messages, each decoded on its own: at most ``MAX_MESSAGES``, each with at most
    ``MAX_PARTS_PER_MESSAGE`` content parts and ``MAX_CONTENT_PARTS`` in all, each bound checked
    before the elements past it are decoded."""
    messages, parts = [], 0
    for i, element in enumerate(items(decode_at(_messages_decoder, raw, "messages"))):
        message = decode_at(_message_decoder, element, f"messages[{i}]")
        content = None
        if given(message.content):
            content = decode_at(_content_decoder, message.content, f"messages[{i}].content")
            if not isinstance(content, str):
                content = items(content)
                parts += len(content)
                if parts > MAX_CONTENT_PARTS:
                    raise invalid(f"the messages hold at most {MAX_CONTENT_PARTS} content parts in all",
                                  f"messages[{i}].content")
        messages.append(ChatMessage(role=message.role, content=content, name=message.name,
                                    tool_calls=message.tool_calls, tool_call_id=message.tool_call_id,
                                    refusal=message.refusal, annotations=message.annotations))
    return messages


def parse_completion_request(body: bytes, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> CompletionRequest:
    """Decode and validate a ``/v1/completions`` body; raises ``OpenAIError`` (400).
    ``max_prompt_tokens``: a longer list of token ids is refused before any is decoded."""
    body_req = decode_body(_completion_decoder, body)
    fields = _common_fields(body_req, CompletionRequest)
    # (a prompt to be truncated may be longer than the context: bounded by the body's size then)
    fields["prompt"] = decode_prompt(body_req.prompt, max_prompt_tokens if body_req.truncate_prompt_tokens is None
                                     else MAX_PROMPT_TOKENS)
    req = CompletionRequest(**fields)
    validate_common(req)
    check_extensions(req)
    if req.max_tokens == 0 and not req.echo:
        raise invalid("max_tokens=0 answers the prompt alone: it needs echo (else max_tokens must be >= 1)",
                      "max_tokens")
    if len(req.prompt) * req.n > MAX_REQUEST_CHOICES:
        raise invalid(f"a request's choices -- its {len(req.prompt)} prompts times n={req.n} -- are at most "
                      f"{MAX_REQUEST_CHOICES}", "n", "too_many_choices")
    if req.best_of is not None and req.best_of < req.n:
        raise invalid(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
    if (req.best_of or 1) > 1 and req.stream:
        raise invalid("best_of > 1 is not streamed (as in OpenAI's API): ask without stream", "best_of")
    if len(req.prompt) * (req.best_of or 1) > MAX_REQUEST_CHOICES:
        raise invalid(f"a request's candidates -- its {len(req.prompt)} prompts times best_of={req.best_of} -- are "
                      f"at most {MAX_REQUEST_CHOICES}", "best_of", "too_many_choices")
    if req.suffix:
        raise invalid("suffix is not supported", "suffix", "unsupported_value")
    return req


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a ``/v1/chat/completions`` body; raises ``OpenAIError`` (400)."""
    body_req = decode_body(_chat_decoder, body)
    fields = _common_fields(body_req, ChatCompletionRequest)
    fields["messages"] = _decode_messages(body_req.messages)
    fields["tools"] = read_tools(body_req.tools, from_msgspec) if given(body_req.tools) else ()
    fields["chat_template_kwargs"] = (read_template_kwargs(body_req.chat_template_kwargs)
                                      if given(body_req.chat_template_kwargs) else None)
    req = ChatCompletionRequest(**fields)
    validate_common(req)
    check_extensions(req, chat=True)
    if req.continue_final_message and req.messages[-1].tool_calls:
        raise invalid("continue_final_message goes on from the last message's text; that message holds tool calls",
                      "continue_final_message", "last_message_not_continuable")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                kind = "refusal" if part.type == "refusal" and m.role == "assistant" else "text"
                if part.type != kind:
                    raise invalid(f"{where}: content part type {part.type!r} is not supported (text only; an "
                                  "assistant's refusal)", where, "unsupported_value")
                if getattr(part, kind) is None:
                    raise invalid(f"{where}: a {kind} part needs '{kind}'", where)
        elif m.content is None and m.role != "assistant":  # (an assistant's may be left out, as in vLLM)
            raise invalid(f"messages[{i}].content is required", f"messages[{i}].content")
        if m.role == "tool" and not m.tool_call_id:
            raise invalid(f"messages[{i}]: a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
        if m.tool_call_id is not None and m.role != "tool":
            raise invalid(f"messages[{i}]: only a tool message has tool_call_id", f"messages[{i}].tool_call_id")
        for field in ("tool_calls", "refusal", "annotations"):
            if getattr(m, field) and m.role != "assistant":
                raise invalid(f"messages[{i}]: only an assistant message has {field}", f"messages[{i}].{field}")
    plan = req.tool_plan()  # a choice the tools cannot meet is a 400 here
    if plan.structured is not None and req.sampling().structured is not None:
        raise invalid(f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined with "
                      "response_format or structured_outputs", "tool_choice")
    return req


# Lax as OpenAI's and vLLM's servers are: a number with an integral value is an integer (JSON
# Schema says so too: 16.0 is a valid "integer", and Python clients send it), and a number or
# boolean may come as a JSON string ("16", "true").  Nothing else is coerced.
_completion_decoder = msgspec.json.Decoder(_CompletionBody, strict=False)
_chat_decoder = msgspec.json.Decoder(_ChatBody, strict=False)
_stop_decoder = msgspec.json.Decoder(str | bounded_list(str, MAX_STOP_STRINGS), strict=False)
_messages_decoder = msgspec.json.Decoder(bounded_list(msgspec.Raw, MAX_MESSAGES, min_items=1))
_message_decoder = msgspec.json.Decoder(_MessageBody, strict=False)
_content_decoder = msgspec.json.Decoder(str | bounded_list(ContentPart, MAX_PARTS_PER_MESSAGE), strict=False)
_logit_bias_decoder = msgspec.json.Decoder(dict[str, float], strict=False)
_metadata_decoder = msgspec.json.Decoder(Metadata, strict=False)


@functools.cache
def _default(cls: type, name: str):
    return next(f.default for f in msgspec.structs.fields(cls) if f.name == name)
