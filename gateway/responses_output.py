"""The Responses API's answers: a response object whole, or as its stream of events.

A response's ``output`` is a list of items: the answer's text as one ``message`` item (its
``output_text`` part), then each tool call as a ``function_call`` item.  Its ``status`` is
``completed``, ``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``: the answer was cut
at ``max_output_tokens``) or ``failed`` (``error``); a background response's is ``queued`` at first,
then ``in_progress``, and may end ``cancelled`` (gateway/background_responses.py).

Streamed, every event is an SSE ``event: <type>`` with its JSON (which names its ``type`` and a
``sequence_number`` counting from 0): ``response.created`` and ``response.in_progress`` first (a
background response's: ``response.created`` and ``response.queued`` at once, ``response.in_progress``
with its first token); an
item's ``response.output_item.added``, its deltas (``response.output_text.delta`` after a
``response.content_part.added``, or ``response.function_call_arguments.delta``), its ``.done`` events
and ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``, or
``response.failed`` after an error) carrying the whole response.  No ``[DONE]``, as OpenAI's.  The
items and text a stream sends are the ones the whole response holds.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Awaitable, Callable

import msgspec

from common.cluster.messages import TokenFrame
from gateway.generation import Generation
from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import CalledFunction, ChatMessage, MessageToolCall
from gateway.openai_responses import ChatDelta, ChatTokenLogprob, now
from gateway.response_shapes import ResponseShapes
from gateway.tool_output import new_call_id
from gateway.response_items import new_item_id
from gateway.response_store import ANSWERED
from gateway.responses_request import ConversationRef, ResponsesCall


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    text: str
    annotations: list = []
    logprobs: list[ChatTokenLogprob] | msgspec.UnsetType = msgspec.UNSET  # with include's logprobs


class OutputMessage(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: str  # in_progress | completed | incomplete
    content: list[OutputText]
    role: str = "assistant"


class FunctionCall(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str  # what the function_call_output answering it names
    name: str
    arguments: str  # JSON text
    status: str


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # input tokens served from the prefix cache
    cache_write_tokens: int = 0  # (OpenAI's explicit cache writes: none here, the prefix cache is automatic)


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    status: str  # queued | in_progress | completed | incomplete | failed | cancelled
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    top_logprobs: int | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    completed_at: int | None = None
    object: str = "response"
    previous_response_id: str | None = None
    conversation: ConversationRef | None = None  # the conversation it is part of
    reasoning: None = None
    store: bool = False  # true where it is stored (gateway/response_store.py)
    background: bool = False
    truncation: str = "disabled"
    service_tier: str = "default"


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponseCreated(_Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseQueued(_Event, tag="response.queued"):  # a background response's, while it waits
    response: ResponseObject


class ResponseCompleted(_Event, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(_Event, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob]


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob]


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


ResponseEvent = (ResponseCreated | ResponseInProgress | ResponseQueued | ResponseCompleted | ResponseIncomplete
                 | ResponseFailed | OutputItemAdded | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta
                 | OutputTextDone | FunctionCallArgumentsDelta | FunctionCallArgumentsDone)

_encode = msgspec.json.Encoder().encode
_LAST_EVENTS = tuple(b"event: " + kind.__struct_config__.tag.encode() + b"\n"
                     for kind in (ResponseCompleted, ResponseIncomplete, ResponseFailed))


def is_last_event(event: bytes) -> bool:
    """Whether ``event`` (one SSE event of a response's stream) is its last."""
    return event.startswith(_LAST_EVENTS)


def sse_events(data: bytes) -> list[bytes]:
    """``data`` (SSE events, each ending in a blank line; their JSON holds no raw newline) one by one."""
    return [event + b"\n\n" for event in data.split(b"\n\n")[:-1]]


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _call_status(arguments: str, status: str) -> str:
    """A call item's status: ``incomplete`` where the answer was cut short inside its arguments."""
    if status == "completed":
        return "completed"
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return "incomplete"
    return "completed"


def _finished_status(gen: Generation) -> tuple[str, IncompleteDetails | None, ResponseError | None]:
    if gen.finish_reason == "length":
        return "incomplete", IncompleteDetails("max_output_tokens"), None
    if gen.finish_reason == "abort":
        return "failed", None, ResponseError("server_error", "the generation was aborted")
    return "completed", None, None


def output_messages(output: list[OutputItem]) -> list[ChatMessage]:
    """A response's output as the conversation's next message: the assistant's text and calls."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [MessageToolCall(id=item.call_id, function=CalledFunction(item.name, item.arguments))
             for item in output if isinstance(item, FunctionCall)]
    return [ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)]


# store(response, its output's messages, its stream's last events) -> whether it was stored
# (gateway/response_store.py, gateway/response_runs.py)
Keeper = Callable[[ResponseObject, list[ChatMessage], list[bytes]], Awaitable[bool]]
# add(response): its input's and output's items added to its conversation (gateway/conversation_items.py)
Joiner = Callable[[ResponseObject], Awaitable[None]]


class ResponsesAnswer:
    """One request's answer in the Responses API's shape (``n`` is 1: one generation); ``keeper``
    stores it once finished (None: not stored); ``joiner`` adds it to its conversation once it has an
    output (None: it is part of none)."""

    max_tokens_field = "max_output_tokens"

    def __init__(self, call: ResponsesCall, shapes: ResponseShapes, keeper: Keeper | None = None,
                 joiner: Joiner | None = None):
        self.call, self.shapes, self.keeper, self.joiner = call, shapes, keeper, joiner
        self.response_id = new_response_id()
        self.created_at = now()

    async def keep(self, response: ResponseObject, closing: list[bytes] = ()) -> None:
        """Store the finished ``response`` (where the request asked; ``closing``: a streamed background
        response's last events, kept with it) -- one that could not be stored says ``store: false`` --
        and add it to its conversation (where it is part of one, and has an output)."""
        if self.joiner is not None and response.status in ANSWERED:  # (first: once a background run's end is
            await self.joiner(response)  # stored, a client polling it may send the next turn)
        if self.keeper is not None and not await self.keeper(response, output_messages(response.output), closing):
            response.store = False

    @property
    def keeps(self) -> bool:
        """Whether its end is kept anywhere (stored, or added to its conversation)."""
        return self.keeper is not None or self.joiner is not None

    def response(self, gen: Generation, status: str, output: list, **extra) -> ResponseObject:
        call, options = self.call, gen.options
        usage = None
        if status not in ("queued", "in_progress"):
            out = len(gen.token_ids)
            usage = ResponseUsage(len(gen.prompt_ids), InputTokensDetails(gen.cached_tokens), out,
                                  OutputTokensDetails(), len(gen.prompt_ids) + out)
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, model=gen.model, output=output,
            usage=usage, instructions=call.instructions, max_output_tokens=call.max_output_tokens,
            temperature=options.temperature, top_p=options.top_p, top_logprobs=call.top_logprobs, tools=call.tools,
            tool_choice=call.tool_choice, parallel_tool_calls=call.chat.parallel_tool_calls, text=call.text,
            metadata=call.metadata, user=call.user, store=self.keeper is not None, background=call.background,
            previous_response_id=call.previous_response_id,
            conversation=ConversationRef(call.conversation_id) if call.conversation_id else None,
            completed_at=now() if status == "completed" else None, **extra)

    def failed(self, gen: Generation, error: OpenAIError, output: list | None = None) -> ResponseObject:
        """The response failed with ``error`` (after ``output``, what it had), under the nearest code
        OpenAI's schema allows: a client's error (a grammar the output broke) ``invalid_prompt``."""
        code = ("rate_limit_exceeded" if error.status == 429 else "invalid_prompt" if 400 <= error.status < 500
                else "server_error")
        return self.response(gen, "failed", output or [], error=ResponseError(code, error.message))

    def logprobs(self, entries) -> list[ChatTokenLogprob] | msgspec.UnsetType:
        """``entries`` as an output text's logprobs; unset where the request did not include them."""
        if not self.call.chat.logprobs:
            return msgspec.UNSET
        found = self.shapes.chat_logprobs(entries)
        return found.content if found is not None else []

    def whole(self, gens: list[Generation]) -> ResponseObject:
        """The finished generation's response."""
        gen = gens[0]
        status, incomplete, error = _finished_status(gen)
        content, calls = gen.tools.final(gen.text) if gen.tools is not None else (gen.text, [])
        # the text ends where the calls begin; the answer's end is the last item's (as a stream closes them)
        item_status = "completed" if calls or status == "completed" else "incomplete"
        output: list = []
        if content or not calls:
            text = OutputText(text=content or "", logprobs=self.logprobs(gen.logprobs if not calls else []))
            output.append(OutputMessage(id=new_item_id("msg"), status=item_status, content=[text]))
        output += [FunctionCall(id=new_item_id("fc"), call_id=new_call_id(), name=c.name, arguments=c.arguments,
                                status=_call_status(c.arguments, status)) for c in calls]
        return self.response(gen, status, output, incomplete_details=incomplete, error=error)

    def stream(self, gen: Generation) -> "ResponseStream":
        return ResponseStream(self, gen)


class ResponseStream:
    """A response's events as its generation goes (gateway/handlers.py writes them)."""

    def __init__(self, answer: ResponsesAnswer, gen: Generation):
        self.answer, self.gen = answer, gen
        self.sequence = 0
        self.output: list[OutputItem] = []  # every item so far; the last may be open
        self.open: OutputItem | None = None
        self.pieces: list[str] = []  # the open item's text or arguments so far (joined when it closes)
        self.pending_logprobs: list = []  # entries not yet sent with a text delta
        self.ending: tuple[bytes, ResponseObject] | None = None  # _end's, once kept
        self.final: ResponseObject | None = None  # the response its last event carries, once sent

    def _event(self, event_type: type[_Event], **fields) -> bytes:
        event = event_type(sequence_number=self.sequence, **fields)
        self.sequence += 1
        tag = event_type.__struct_config__.tag
        return b"event: " + tag.encode() + b"\ndata: " + _encode(event) + b"\n\n"

    def opening(self) -> bytes:
        return self.queued() if self.answer.call.background else self.started()

    def queued(self) -> bytes:
        """A background response's opening, at once: created and queued."""
        shell = self.answer.response(self.gen, "queued", [])
        return self._event(ResponseCreated, response=shell) + self._event(ResponseQueued, response=shell)

    def started(self) -> bytes:
        """In progress (a foreground response's opening: created, too)."""
        shell = self.answer.response(self.gen, "in_progress", [])
        created = b"" if self.answer.call.background else self._event(ResponseCreated, response=shell)
        return created + self._event(ResponseInProgress, response=shell)

    def batch(self, gen: Generation, batch: list[tuple[str, TokenFrame]]) -> bytes:
        """The events of a batch of frames (their text deltas, tool calls and logprobs; ``gen`` is this
        stream's one generation)."""
        out = []
        last = len(batch) - 1
        for i, (delta, frame) in enumerate(batch):
            ending = i == last and gen.finish_reason is not None
            if gen.tools is None:  # (with tools, the text's logprobs come with its end: see _close)
                if self.answer.call.chat.logprobs and frame.logprobs:
                    self.pending_logprobs += frame.logprobs
                if delta:
                    out.append(self._text(delta))
                continue
            deltas: list[ChatDelta] = gen.tools.step(delta) + (gen.tools.finish() if ending else [])
            for d in deltas:
                if d.content:
                    out.append(self._text(d.content))
                for call in d.tool_calls or ():
                    if call.id:  # a call's first delta: its id and name
                        out.append(self._open_call(call.id, call.function.name))
                    if call.function and call.function.arguments:
                        out.append(self._arguments(call.function.arguments))
        return b"".join(out)

    async def keep(self) -> None:
        """The stream's end (``closing``'s) settled and its response stored, before ``closing`` sends it."""
        if self.answer.keeps:
            self.ending = self._end()
            await self.answer.keep(self.ending[1])

    def closing(self) -> bytes:
        """The open item's end, then the whole response."""
        ends, response = self.ending or self._end()
        self.final = response
        kind = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete}.get(response.status, ResponseFailed)
        return ends + self._event(kind, response=response)

    def _end(self) -> tuple[bytes, ResponseObject]:
        """The open item's end events, and the whole response."""
        gen = self.gen
        status, incomplete, error = _finished_status(gen)
        out = [self._close()]
        if not self.output:  # no text, no call: an empty message, as the whole response has
            out += [self._text(""), self._close()]
        return b"".join(out), self.answer.response(gen, status, self.output, incomplete_details=incomplete, error=error)

    def failure(self, error: OpenAIError) -> bytes:
        """An error after the stream started: the response failed, with what it had."""
        response = self.final = self.answer.failed(self.gen, error, self.output)
        response.store = self.answer.call.background  # a stream that failed is not stored, but a background one
        return self._close(failed=True) + self._event(ResponseFailed, response=response)

    # ---- items ---------------------------------------------------------------------------------

    def _text(self, delta: str) -> bytes:
        out = b""
        if not isinstance(self.open, OutputMessage):
            out += self._close()
            item = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
            out += self._add(item)
            part = OutputText(text="", logprobs=self.answer.logprobs([]))
            item.content.append(part)
            out += self._event(ContentPartAdded, item_id=item.id, output_index=self._index, content_index=0,
                               part=OutputText(text=""))
        part = self.open.content[0]
        self.pieces.append(delta)
        logprobs = self.answer.logprobs(self.pending_logprobs) if self.pending_logprobs else []
        self.pending_logprobs = []
        if logprobs and part.logprobs is not msgspec.UNSET:
            part.logprobs += logprobs
        if not delta:
            return out
        return out + self._event(OutputTextDelta, item_id=self.open.id, output_index=self._index, content_index=0,
                                 delta=delta, logprobs=logprobs or [])

    def _open_call(self, call_id: str, name: str) -> bytes:
        out = self._close(followed=True)
        return out + self._add(FunctionCall(id=new_item_id("fc"), call_id=call_id, name=name, arguments="",
                                            status="in_progress"))

    def _arguments(self, fragment: str) -> bytes:
        self.pieces.append(fragment)
        return self._event(FunctionCallArgumentsDelta, item_id=self.open.id, output_index=self._index, delta=fragment)

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _add(self, item: OutputItem) -> bytes:
        self.output.append(item)
        self.open, self.pieces = item, []
        return self._event(OutputItemAdded, output_index=self._index, item=msgspec.structs.replace(
            item, content=[]) if isinstance(item, OutputMessage) else msgspec.structs.replace(item))

    def _close(self, failed: bool = False, followed: bool = False) -> bytes:
        """The open item's ``.done`` events (none open: nothing); ``failed``: it ends incomplete;
        ``followed``: a call comes after it (a text so closed is complete, as ``whole`` tells it)."""
        item, self.open = self.open, None
        if item is None:
            return b""
        index = self.output.index(item)
        status = "failed" if failed else _finished_status(self.gen)[0]
        if isinstance(item, FunctionCall):
            item.arguments = "".join(self.pieces)
            item.status = _call_status(item.arguments, status)
            return (self._event(FunctionCallArgumentsDone, item_id=item.id, output_index=index, arguments=item.arguments)
                    + self._event(OutputItemDone, output_index=index, item=item))
        part = item.content[0]
        part.text = "".join(self.pieces)
        if part.logprobs is not msgspec.UNSET:
            if self.gen.tools is None:
                part.logprobs += self.answer.logprobs(self.pending_logprobs)
            else:  # an answer's tokens are its text's when it made no call (as ``whole`` tells them)
                part.logprobs = self.answer.logprobs([] if self.gen.tools.made_calls else self.gen.logprobs)
            self.pending_logprobs = []
        item.status = "completed" if followed or status == "completed" else "incomplete"
        logprobs = part.logprobs if part.logprobs is not msgspec.UNSET else []
        return (self._event(OutputTextDone, item_id=item.id, output_index=index, content_index=0, text=part.text,
                            logprobs=logprobs)
                + self._event(ContentPartDone, item_id=item.id, output_index=index, content_index=0, part=part)
                + self._event(OutputItemDone, output_index=index, item=item))
