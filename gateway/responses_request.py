"""OpenAI's Responses API request (``POST /v1/responses``), read into the chat path's request.

A response is a chat completion in another shape: ``input`` (a string, or a list of items) and
``instructions`` become the chat's messages, ``max_output_tokens`` its ``max_completion_tokens``,
``text.format`` its ``response_format``, the flat function ``tools`` and ``tool_choice`` the chat's,
``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` its logprobs.  The chat path then
routes, constrains and parses it as any chat request (gateway/handlers.py), and
gateway/responses_output.py answers in this API's shape.

    input item                        chat message
    {"role", "content"} (a message)   that role's message, its text parts joined
    {"type": "function_call"}         an assistant message's tool call (consecutive calls, and the
                                      assistant text right before them, make one message)
    {"type": "function_call_output"}  a tool message answering ``call_id``
    {"type": "reasoning"}             left out (a reasoning model's; this model has no reasoning)

A response is stored unless ``store: false`` says otherwise, and ``previous_response_id`` continues
a stored one (gateway/response_store.py: the handler prepends its conversation, ``ResponsesCall.
continuing``); ``background: true`` runs it in the background (gateway/background_responses.py: it
is stored, so ``store: false`` is a 400).
``conversation`` makes it part of a conversation (gateway/conversation_store.py: its items are read
before the input, and its input and output added to them once it ends; not with
``previous_response_id``).  The built-in tools, non-text content and ``truncation: "auto"`` are a 400
naming the field; ``reasoning``, ``text.verbosity``, ``service_tier`` and ``prompt_cache_key`` are
accepted and not used, as on the chat endpoint (this model does not reason; the router finds shared
prefixes itself).  The bounds are the chat path's: the items as its messages, their parts as its
content parts, each bound checked before the elements past it are decoded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from common.engine.structured.spec import StructuredOutput
from gateway.json_bounds import bounded_list, items
from gateway.openai_errors import from_msgspec, invalid, required
from gateway.openai_protocol import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_PARTS_PER_MESSAGE, CacheSalt, CalledFunction, ChatCompletionRequest,
    ChatMessage, Logprobs, MaxTokens, Metadata, MessageToolCall, MinP, MinTokens, ModelName, Penalty, RepetitionPenalty,
    StopTokenIds, Temperature, TopP, UserId, decode_at, decode_body, given, join_parts, read_metadata, read_stop,
    validate_common,
)
from gateway.request_extensions import PromptCacheKey, ReasoningEffort, ServiceTier, Verbosity
from gateway.structured_request import StructuredOutputsParams, grammar_json, read_structured_outputs, schema_text
from gateway.tools_request import MAX_TOOLS, FlatFunctionTool, FunctionName, NamedFunction, NamedToolChoice, read_tools

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What ``include`` may name: the answer's logprobs; a reasoning model's encrypted reasoning, which
# asks for nothing here (no reasoning item is produced).
INCLUDABLE = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
CallId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ConversationId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = True  # OpenAI's padding of deltas against side channels: not sent here
    # the chat's (load tools send it here too): accepted; the usage is in response.completed either way
    include_usage: bool | None = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``text.format``: plain text, any JSON object, or JSON valid by ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")] | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: Verbosity | None = None  # a hint (accepted, not used)


class Reasoning(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A reasoning model's settings: accepted, not used (this model does not reason)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ConversationRef(msgspec.Struct, forbid_unknown_fields=True):
    """``conversation`` as an object: the conversation's id."""

    id: ConversationId


class NamedFunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: FunctionName


ResponsesToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class InputPart(msgspec.Struct, kw_only=True):
    """A content part of an input item (unknown fields allowed: an output part sent back carries its
    annotations and logprobs; an image part gets "text only" rather than "unknown field")."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of ``input``, any kind (checked by kind in ``read_input_item``); unknown fields allowed: an
    output item sent back carries its ``id``, ``status`` and the like."""

    type: str | None = None
    role: str | None = None
    content: msgspec.Raw = msgspec.Raw()
    call_id: CallId | None = None
    name: FunctionName | None = None
    arguments: str | None = None
    output: msgspec.Raw = msgspec.Raw()


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses`` (its schema is the OpenAPI document's; bodies decode as ``_ResponsesBody``;
    a field of ``NULL_IS_DEFAULT`` sent as null reads as its default)."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("parallel_tool_calls", "stream", "background", "ignore_eos",
                                                  "min_tokens")

    model: ModelName
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_MESSAGES)]  # items: see InputItem
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: Logprobs | None = None
    include: Annotated[list[Literal[INCLUDABLE]], msgspec.Meta(max_length=len(INCLUDABLE))] | None = None
    tools: Annotated[list[FlatFunctionTool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # unset: stored where the gateway stores responses (gateway/response_store.py)
    background: bool | None = False  # run in the background (gateway/background_responses.py)
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    conversation: ConversationId | ConversationRef | None = None  # (gateway/conversation_store.py)
    metadata: Metadata | None = None
    user: UserId | None = None
    safety_identifier: UserId | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop early items to fit) is not offered
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None  # built-in tools' bound: none here
    # OpenAI's, accepted and not used: one service tier; the router finds shared prefixes itself
    service_tier: ServiceTier | None = None
    prompt_cache_key: PromptCacheKey | None = None
    reasoning: Reasoning | None = None
    # Extensions (vLLM's, as on the other endpoints)
    top_k: int | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    min_tokens: MinTokens | None = 0
    cache_salt: CacheSalt | None = None
    structured_outputs: StructuredOutputsParams | None = None


class _ResponsesBody(ResponsesRequest):
    """What a body decodes to: the fields a body can fill with many elements, as their JSON."""

    input: msgspec.Raw
    tools: msgspec.Raw = msgspec.Raw()
    stop: msgspec.Raw = msgspec.Raw()
    metadata: msgspec.Raw = msgspec.Raw()
    text: msgspec.Raw = msgspec.Raw()
    structured_outputs: msgspec.Raw = msgspec.Raw()
    conversation: msgspec.Raw = msgspec.Raw()


@dataclass(frozen=True)
class ResponsesCall:
    """A Responses request: the chat request that computes it, and what its answer repeats of it."""

    chat: ChatCompletionRequest
    instructions: str | None
    tools: list[dict]  # as the answer lists them (the flat function tools)
    tool_choice: Any  # as sent (a string or {"type": "function", "name"}), "auto" / "none" by default
    text: dict  # {"format": {...}}
    max_output_tokens: int | None
    top_logprobs: int | None
    metadata: dict
    user: str | None
    store: bool | None  # as sent
    background: bool
    previous_response_id: str | None
    input_messages: list[ChatMessage]  # the input's, without the instructions' system message
    conversation_id: str | None = None  # the conversation it reads and adds to

    @property
    def turns(self) -> list[ChatMessage]:
        """The conversation a stored response keeps: the chat's messages but the instructions' system
        message (its instructions are not carried over) -- a response in a conversation keeps its
        input alone (the conversation holds the rest: kept with each response, it would be stored
        again at every turn)."""
        if self.conversation_id is not None:
            return self.input_messages
        return self.chat.messages[1:] if self.instructions else self.chat.messages

    def check_call_outputs(self) -> "ResponsesCall":
        """This call, once every ``function_call_output`` answers a function call made before it (in its
        input, or in the history it continues); else a 400, as OpenAI's API answers."""
        called: set[str] = set()
        for message in self.chat.messages:
            called.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in called:
                raise invalid(f"No tool call found for function call output with call_id {message.tool_call_id}.",
                              "input", "function_call_not_found")
        return self

    def continuing(self, history: list[ChatMessage], field: str = "previous_response_id") -> "ResponsesCall":
        """This call after ``history`` (the conversation of the response it continues, or the items of
        the conversation it is part of: ``field``): its chat's messages are the instructions' system
        message, ``history``, then its input's."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        messages = system + history + self.input_messages
        if len(messages) > MAX_MESSAGES:
            raise invalid(f"the conversation after {field} holds {len(messages)} messages, over "
                          f"{MAX_MESSAGES}; send a shorter one in input", field)
        return replace(self, chat=msgspec.structs.replace(self.chat, messages=messages))


class _CountBody(_ResponsesBody):
    """``POST /v1/responses/input_tokens``: a response's request whose model and input may be left out."""

    model: ModelName | None = None
    input: msgspec.Raw = msgspec.Raw()


_body_decoder = msgspec.json.Decoder(_ResponsesBody, strict=False)
_count_decoder = msgspec.json.Decoder(_CountBody, strict=False)
_items_decoder = msgspec.json.Decoder(str | bounded_list(msgspec.Raw, MAX_MESSAGES), strict=False)
_item_decoder = msgspec.json.Decoder(InputItem, strict=False)
_parts_decoder = msgspec.json.Decoder(str | bounded_list(InputPart, MAX_PARTS_PER_MESSAGE), strict=False)
_text_decoder = msgspec.json.Decoder(TextConfig, strict=False)
_conversation_decoder = msgspec.json.Decoder(ConversationId | ConversationRef | None, strict=False)


def parse_responses_request(body: bytes, counting_for: str | None = None) -> ResponsesCall:
    """Decode and validate a ``/v1/responses`` body; raises ``OpenAIError`` (400).  ``counting_for``:
    an ``/v1/responses/input_tokens`` body, its model (where left out) this one, its input optional."""
    req = decode_body(_count_decoder if counting_for else _body_decoder, body)
    if counting_for:
        req.model = req.model or counting_for
    conversation_id = _conversation_id(req.conversation) if given(req.conversation) else None
    for field, refused, why in (("conversation", conversation_id is not None and req.previous_response_id is not None,
                                 "a response continues either a conversation or previous_response_id, not both"),
                                ("store", req.background and req.store is False,
                                 "a background response is stored (background: true needs store)")):
        if refused:
            raise invalid(f"{field}: {why}", field, "unsupported_value")
    input_messages = read_input(req.input) if given(req.input) else []
    messages = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + input_messages
    if not messages and req.previous_response_id is None and conversation_id is None:
        raise invalid("input holds no message (and there are no instructions)", "input")
    tools = read_tools(req.tools, from_msgspec, flat=True) if given(req.tools) else ()
    text = decode_at(_text_decoder, grammar_json(req.text, "text"), "text") if given(req.text) else None
    structured = _text_format(text)
    extension = read_structured_outputs(req.structured_outputs, from_msgspec) if given(req.structured_outputs) else None
    if structured is not None and extension is not None:
        raise invalid("text.format and structured_outputs both constrain the output; send one", "structured_outputs")
    choice = req.tool_choice
    logprobs = LOGPROBS_INCLUDE in (req.include or ())
    if req.top_logprobs is not None and not logprobs:
        raise invalid(f"top_logprobs needs include: [\"{LOGPROBS_INCLUDE}\"]", "top_logprobs")
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=req.seed,
        stop=read_stop(req.stop) if given(req.stop) else None, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, cache_salt=req.cache_salt, stream=req.stream,
        user=req.user, safety_identifier=req.safety_identifier,
        metadata=read_metadata(req.metadata) if given(req.metadata) else None,
        logprobs=logprobs, top_logprobs=req.top_logprobs if logprobs else None,
        response_format=structured, structured_outputs=extension, tools=tools,
        tool_choice=NamedToolChoice("function", NamedFunction(choice.name)) if isinstance(choice, NamedFunctionChoice)
        else choice, parallel_tool_calls=req.parallel_tool_calls)
    validate_common(chat)
    plan = chat.tool_plan()  # a choice the tools cannot meet is a 400 here
    if plan.structured is not None and chat.sampling().structured is not None:
        raise invalid(f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined with "
                      "text.format or structured_outputs", "tool_choice")
    listed = [{"type": "function", **msgspec.to_builtins(t.function)} for t in tools]
    text_format = msgspec.to_builtins(text.format) if text is not None and text.format else {"type": "text"}
    return ResponsesCall(chat, req.instructions, listed,
                         msgspec.to_builtins(choice) if choice is not None else plan.mode, {"format": text_format},
                         req.max_output_tokens, req.top_logprobs, chat.metadata or {}, req.user, req.store,
                         req.background, req.previous_response_id, input_messages, conversation_id)


def _conversation_id(raw: msgspec.Raw) -> str | None:
    conversation = decode_at(_conversation_decoder, raw, "conversation")
    return conversation.id if isinstance(conversation, ConversationRef) else conversation


def _text_format(text: TextConfig | None) -> StructuredOutput | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object", "", "text.format")
    if fmt.schema is None or fmt.name is None:
        missing = "schema" if fmt.schema is None else "name"
        raise invalid(f"text.format of type json_schema needs {missing}", f"text.format.{missing}")
    return StructuredOutput("json_schema", schema_text(fmt.schema, "text.format"), "text.format")





def read_input(raw: msgspec.Raw, field: str = "input", split_calls: bool = False) -> list[ChatMessage]:
    """``input`` (or another list of items: ``field`` names it) as chat messages (the table in the
    module's docstring); ``split_calls``: consecutive function calls past ``MAX_TOOLS`` begin another
    assistant message (a conversation's items, added some at a time) instead of a 400."""
    decoded = decode_at(_items_decoder, raw, field)
    if isinstance(decoded, str):
        return [ChatMessage(role="user", content=decoded)]
    messages: list[ChatMessage] = []
    parts = 0
    joins_calls = False  # the last message is an assistant's that the next function_call joins
    for i, element in enumerate(items(decoded)):
        at = f"{field}[{i}]"
        message, count = read_input_item(element, at)
        if message is None:
            continue
        calls = message.content is None  # a function_call item
        if calls and joins_calls and not (split_calls and len(messages[-1].tool_calls or ()) >= MAX_TOOLS):
            last = messages[-1]
            if len(last.tool_calls or ()) >= MAX_TOOLS:
                raise invalid(f"{at}: at most {MAX_TOOLS} consecutive function calls", at)
            last.tool_calls = [*(last.tool_calls or ()), *message.tool_calls]
        else:
            messages.append(message)
        joins_calls = message.role == "assistant"
        parts += count
        if parts > MAX_CONTENT_PARTS:
            raise invalid(f"the input holds at most {MAX_CONTENT_PARTS} content parts in all", at)
    return messages


def read_input_item(element: msgspec.Raw, at: str) -> tuple[ChatMessage | None, int]:
    """One input item (its JSON; ``at`` names it) as a chat message -- a ``function_call`` as an
    assistant message of that one call and no content, a ``reasoning`` item as None -- and how many
    content parts it had."""
    item = decode_at(_item_decoder, element, at)
    kind = item.type or ("message" if item.role is not None else None)
    if kind == "message":
        if item.role not in ("user", "system", "developer", "assistant"):
            raise invalid(f"{at}.role must be user, system, developer or assistant, got {item.role!r}", f"{at}.role")
        text, count = _text(item.content, f"{at}.content")
        return ChatMessage(role=item.role, content=text), count
    if kind == "function_call":
        call = MessageToolCall(id=required(item.call_id, at, "call_id"),
                               function=CalledFunction(required(item.name, at, "name"),
                                                       required(item.arguments, at, "arguments")))
        return ChatMessage(role="assistant", content=None, tool_calls=[call]), 0
    if kind == "function_call_output":
        text, count = _text(item.output, f"{at}.output")
        return ChatMessage(role="tool", content=text, tool_call_id=required(item.call_id, at, "call_id")), count
    if kind == "reasoning":
        return None, 0
    raise invalid(f"{at}: input items of type {kind!r} are not supported (messages, function_call, "
                  "function_call_output)", f"{at}.type", "unsupported_value")


def _text(raw: msgspec.Raw, at: str) -> tuple[str, int]:
    """A content (or a call's output): a string, or text parts joined; and how many parts it had."""
    if not given(raw):
        raise invalid(f"Missing required parameter: '{at}'.", at, "missing_required_parameter")
    content = decode_at(_parts_decoder, raw, at)
    if isinstance(content, str):
        return content, 0
    pieces = items(content)
    for j, part in enumerate(pieces):
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in ("input_text", "output_text", "refusal"):
            raise invalid(f"{at}[{j}]: content part type {part.type!r} is not supported (text only)", f"{at}[{j}]",
                          "unsupported_value")
        if text is None:
            raise invalid(f"{at}[{j}]: a {part.type} part needs '{'refusal' if part.type == 'refusal' else 'text'}'",
                          f"{at}[{j}]")
    return join_parts(p.refusal if p.type == "refusal" else p.text for p in pieces), len(pieces)
