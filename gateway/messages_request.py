"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``), read into
the chat path's request.

    Messages API                               chat
    system (a string or text blocks)           the system message
    a user turn's text blocks                  a user message (consecutive text blocks joined)
    a user turn's tool_result blocks           a tool message each, answering ``tool_use_id``
    an assistant turn's text and tool_use      an assistant message and its tool calls
    thinking / redacted_thinking blocks        left out (this model has no reasoning)
    max_tokens, stop_sequences, temperature,   max_completion_tokens, stop, temperature, top_p, top_k
    top_p, top_k
    tools ({name, description, input_schema})  function tools
    tool_choice auto / any / tool / none       auto / required / the named function / none
    (disable_parallel_tool_use)                (parallel_tool_calls false)
    output_config.format (json_schema)         response_format
    a last turn of the assistant's text        the answer continues it (Anthropic's prefill)

The chat path then routes, constrains and parses it (gateway/handlers.py); gateway/messages_output.py
answers in this API's shape.  Images, documents, server tools (``bash_*``, ``web_search_*``, ...),
``thinking`` enabled and ``output_config.effort`` are 400s naming the field; so is every unknown
field.  The bounds are the chat path's: messages, their blocks and all blocks together counted
before the elements past the bound are decoded; a tool call's ``input`` is kept as its JSON text.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from common.engine.structured.spec import StructuredOutput
from gateway.json_bounds import bounded_list, items
from gateway.openai_errors import OpenAIError, from_msgspec, invalid, required
from gateway.openai_protocol import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_PARTS_PER_MESSAGE, CacheSalt, CalledFunction, ChatCompletionRequest,
    ChatMessage, MaxTokens, MessageToolCall, ModelName, TopP, UserId, decode_at, decode_body, given, read_stop,
    join_parts, validate_common,
)
from gateway.structured_request import grammar_json, read_structured_outputs, schema_text
from gateway.tools_request import (
    MAX_TOOLS, FunctionDefinition, FunctionName, NamedFunction, NamedToolChoice, Tool, check_tools,
)

ToolUseId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class CustomTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A client tool (``type`` "custom" or left out); server tools have other types, refused."""

    name: FunctionName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: the prefix cache needs none

    def as_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(name=self.name, description=self.description,
                                                                 parameters=self.input_schema, strict=self.strict))


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["disabled"]  # "enabled" / "adaptive": this model has no reasoning


class JsonOutputFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: JsonOutputFormat | None = None


class CacheControl(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Anthropic's prompt-caching hint (accepted, not needed: every prompt's prefix is cached here)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class MessagesMetadata(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    user_id: UserId | None = None  # accepted, not used


class Block(msgspec.Struct, kw_only=True):
    """A content block, any type (checked by type in ``_turns``; unknown fields allowed: a block sent
    back carries its citations, ``cache_control`` and the like)."""

    type: str
    text: str | None = None
    id: ToolUseId | None = None  # tool_use
    name: FunctionName | None = None  # tool_use
    input: msgspec.Raw = msgspec.Raw()  # tool_use: a JSON object, kept as its text
    tool_use_id: ToolUseId | None = None  # tool_result
    content: msgspec.Raw = msgspec.Raw()  # tool_result: a string or text blocks
    is_error: bool = False  # tool_result: the tool failed (its content says how)


class Turn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant"]
    content: msgspec.Raw


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages`` (``max_tokens`` is required there, not by ``count_tokens``)."""

    model: ModelName
    messages: msgspec.Raw
    max_tokens: MaxTokens | None = None
    system: msgspec.Raw = msgspec.Raw()
    stop_sequences: msgspec.Raw = msgspec.Raw()
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool = False
    metadata: MessagesMetadata | None = None
    tools: msgspec.Raw = msgspec.Raw()
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: msgspec.Raw = msgspec.Raw()
    service_tier: Literal["auto", "standard_only"] | None = None  # Anthropic's: one tier here (accepted, not used)
    cache_control: CacheControl | None = None  # automatic prompt caching (accepted, not used)
    # Extensions (vLLM's, as on the other endpoints)
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None
    structured_outputs: msgspec.Raw = msgspec.Raw()


_body_decoder = msgspec.json.Decoder(MessagesRequest, strict=False)
_turns_decoder = msgspec.json.Decoder(bounded_list(msgspec.Raw, MAX_MESSAGES, min_items=1), strict=False)
_turn_decoder = msgspec.json.Decoder(Turn, strict=False)
_blocks_decoder = msgspec.json.Decoder(str | bounded_list(Block, MAX_PARTS_PER_MESSAGE), strict=False)
_tools_decoder = msgspec.json.Decoder(Annotated[list[CustomTool], msgspec.Meta(max_length=MAX_TOOLS)], strict=False)
_output_config_decoder = msgspec.json.Decoder(OutputConfig, strict=False)


def parse_messages_request(body: bytes, counting: bool = False) -> ChatCompletionRequest:
    """A ``/v1/messages`` body (``counting``: a ``count_tokens`` one, which has no ``max_tokens``) decoded,
    validated and read into the chat request that computes it; raises ``OpenAIError`` (400)."""
    req = decode_body(_body_decoder, body)
    if req.max_tokens is None and not counting:
        raise invalid("Missing required parameter: 'max_tokens'.", "max_tokens", "missing_required_parameter")
    blocks = _Blocks()
    system = [ChatMessage(role="system", content=blocks.text(req.system, "system", "".join))] if given(req.system) else []
    messages = system + _turns(req.messages, blocks)
    tools = tuple(t.as_tool() for t in decode_at(_tools_decoder, grammar_json(req.tools, "tools"), "tools")) \
        if given(req.tools) else ()
    check_tools(tools, "tools[{}].input_schema")
    structured = _output_format(req.output_config)
    extension = read_structured_outputs(req.structured_outputs, from_msgspec) if given(req.structured_outputs) else None
    if structured is not None and extension is not None:
        raise invalid("output_config.format and structured_outputs both constrain the output; send one",
                      "structured_outputs")
    if req.tool_choice is not None and req.tool_choice.type != "none" and not tools:
        raise invalid(f"tool_choice {req.tool_choice.type!r} needs tools", "tool_choice")
    choice, parallel = _tool_choice(req.tool_choice)
    prefilled = messages[-1].role == "assistant" and not messages[-1].tool_calls
    if prefilled and messages[-1].content and messages[-1].content[-1].isspace():
        raise invalid("the final assistant content (a prefill) cannot end with trailing whitespace", "messages")
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k or None, seed=req.seed, ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
        stop=_stop_sequences(req.stop_sequences) if given(req.stop_sequences) else None, stream=req.stream,
        user=req.metadata.user_id if req.metadata else None, response_format=structured,
        structured_outputs=extension, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        # a conversation ending in the assistant's text goes on from it (Anthropic's prefill)
        continue_final_message=prefilled)
    try:
        validate_common(chat)
    except OpenAIError as exc:  # its stop strings are this API's stop_sequences
        if exc.param == "stop":
            exc.param, exc.message = "stop_sequences", exc.message.replace("stop", "stop_sequences", 1)
        raise
    plan = chat.tool_plan()  # a choice the tools cannot meet is a 400 here
    if prefilled and (plan.structured is not None or chat.sampling().structured is not None):
        raise invalid("a conversation ending in the assistant's text (a prefill) cannot be constrained too: "
                      "output_config.format, structured_outputs and tool_choice any / tool start a new answer",
                      "messages", "prefill_not_constrainable")
    if plan.structured is not None and chat.sampling().structured is not None:
        raise invalid(f"tool_choice {req.tool_choice.type!r} constrains the output itself; it cannot be combined "
                      "with output_config.format or structured_outputs", "tool_choice")
    return chat


def _stop_sequences(raw: msgspec.Raw) -> list[str]:
    stop = read_stop(raw, "stop_sequences")
    if isinstance(stop, str):  # (the OpenAI endpoints' stop may be one string; this API's is a list)
        raise invalid("stop_sequences must be a list of strings", "stop_sequences")
    return stop


def _tool_choice(choice: ToolChoice | None):
    """The chat's ``tool_choice`` and ``parallel_tool_calls`` for the Messages API's ``tool_choice``."""
    if choice is None:
        return None, True
    if choice.type == "tool":
        if choice.name is None:
            raise invalid("Missing required parameter: 'tool_choice.name'.", "tool_choice.name",
                          "missing_required_parameter")
        return NamedToolChoice("function", NamedFunction(choice.name)), not choice.disable_parallel_tool_use
    return {"any": "required"}.get(choice.type, choice.type), not choice.disable_parallel_tool_use


def _output_format(raw: msgspec.Raw) -> StructuredOutput | None:
    config = decode_at(_output_config_decoder, grammar_json(raw, "output_config"), "output_config") if given(raw) else None
    if config is None or config.format is None:
        return None
    return StructuredOutput("json_schema", schema_text(config.format.schema, "output_config.format"),
                            "output_config.format")


class _Blocks:
    """Counts the request's content blocks against ``MAX_CONTENT_PARTS`` and reads text from them."""

    def __init__(self):
        self.count = 0

    def decode(self, raw: msgspec.Raw, at: str) -> str | list[Block]:
        content = decode_at(_blocks_decoder, raw, at)
        if isinstance(content, str):
            return content
        content = items(content)
        self.count += len(content)
        if self.count > MAX_CONTENT_PARTS:
            raise invalid(f"the messages hold at most {MAX_CONTENT_PARTS} content blocks in all", at)
        return content

    def text(self, raw: msgspec.Raw, at: str, join=join_parts) -> str:
        """A string, or text blocks joined (a tool result's content; ``system``'s run on, ``join``: as
        vLLM's Messages API joins them)."""
        content = self.decode(raw, at)
        if isinstance(content, str):
            return content
        for j, block in enumerate(content):
            _check_text(block, f"{at}[{j}]")
        return join(block.text for block in content)


def _check_text(block: Block, at: str) -> None:
    if block.type != "text":
        raise invalid(f"{at}: content blocks of type {block.type!r} are not supported here (text only)", f"{at}.type",
                      "unsupported_value")
    if block.text is None:
        raise invalid(f"Missing required parameter: '{at}.text'.", f"{at}.text", "missing_required_parameter")


def _turns(raw: msgspec.Raw, blocks: _Blocks) -> list[ChatMessage]:
    """The conversation's turns as chat messages (the table in the module's docstring)."""
    messages: list[ChatMessage] = []
    for i, element in enumerate(items(decode_at(_turns_decoder, raw, "messages"))):
        at = f"messages[{i}]"
        turn = decode_at(_turn_decoder, element, at)
        content = blocks.decode(turn.content, f"{at}.content")
        if isinstance(content, str):
            messages.append(ChatMessage(role=turn.role, content=content))
        elif turn.role == "assistant":
            messages.append(_assistant(content, f"{at}.content"))
        else:
            messages += _user(content, f"{at}.content", blocks)
    return messages


def _assistant(content: list[Block], at: str) -> ChatMessage:
    text, calls = [], []
    for j, block in enumerate(content):
        where = f"{at}[{j}]"
        if block.type == "tool_use":
            calls.append(MessageToolCall(id=required(block.id, where, "id"), function=CalledFunction(
                required(block.name, where, "name"), _object_text(block.input, f"{where}.input"))))
        elif block.type not in ("thinking", "redacted_thinking"):
            _check_text(block, where)
            text.append(block.text)
    return ChatMessage(role="assistant", content=join_parts(text) if text or not calls else None, tool_calls=calls or None)


def _user(content: list[Block], at: str, blocks: _Blocks) -> list[ChatMessage]:
    """A user turn: a tool message per tool_result, the text between them as user messages."""
    out: list[ChatMessage] = []
    text: list[str] = []
    for j, block in enumerate(content):
        where = f"{at}[{j}]"
        if block.type == "tool_result":
            if text:
                out.append(ChatMessage(role="user", content=join_parts(text)))
                text = []
            result = blocks.text(block.content, f"{where}.content") if given(block.content) else ""
            if block.is_error:  # chat templates have no such flag: the result says it
                result = f"Error: {result}"
            out.append(ChatMessage(role="tool", content=result,
                                   tool_call_id=required(block.tool_use_id, where, "tool_use_id")))
        else:
            _check_text(block, where)
            text.append(block.text)
    if text or not out:
        out.append(ChatMessage(role="user", content=join_parts(text)))
    return out


def _object_text(raw: msgspec.Raw, at: str) -> str:
    """A tool call's ``input``: a JSON object, as its text (checked to be one, not decoded into objects)."""
    try:
        text = bytes(raw).decode().strip() if given(raw) else ""
    except UnicodeDecodeError:
        raise invalid(f"{at} is not valid UTF-8", at) from None
    if not text.startswith("{"):
        raise invalid(f"{at} must be a JSON object", at)
    return text
