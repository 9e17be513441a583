"""The OpenAI endpoints: validate, tokenize, dispatch, detokenize, answer (JSON or SSE)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Awaitable, Callable

from aiohttp import web

from common.cluster.messages import TokenFrame
from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import GrammarError
from common.engine.structured.compiler import GrammarCompiler
from gateway.chat_template import ChatFormat
from gateway.config import GatewayConfig
from gateway.detokenizer import StreamingDecoder
from gateway.dispatch import DispatchResult, Dispatcher, Saturated, UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptEncoder
from gateway.tenants import Tenant, cache_salt
from gateway.tool_output import ToolOutput
from gateway.tool_parsers import ToolCallParser
from gateway.tools_request import ToolPlan
from gateway.openai_protocol import (
    SSE_DONE, SSE_HEADERS, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionChunk,
    CompletionLogprobs, CompletionResponse, OpenAIError, SamplingOptions, TopLogprob, Usage, invalid,
    json_response, new_request_id, now, parse_chat_request, parse_completion_request, sse_event,
)

log = logging.getLogger(__name__)


class _ClientTooSlow(Exception):
    """The client accepted no bytes for ``client_write_timeout`` seconds."""


async def _drain(run) -> None:
    async for _ in run:
        pass


@dataclass
class Generation:
    """One accepted request on its way through the gateway."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    options: SamplingOptions
    params: SamplingParams
    cache_salt: str | None = None  # as served (gateway/tenants.py: the client's, or per API key)
    key_id: str | None = None  # its API key (Tenant.key_id): its share of the wait queue
    arrival: float = field(default_factory=time.monotonic)
    pieces: list[str] = field(default_factory=list)  # the text, as streamed (joined once at the end)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    tools: ToolOutput | None = None  # a chat request whose answer may hold tool calls

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True)
class HandlerServices:
    """What the OpenAI handlers use of the gateway: the served model's facts and tokenizer, the
    prompt encoder, the dispatcher, metrics, and the gateway's bounds on bodies and admission."""

    config: GatewayConfig
    model_id: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # a transformers tokenizer
    chat_format: ChatFormat
    prompts: PromptEncoder
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    read_body: Callable[[web.Request], Awaitable[bytes]]  # whole, bounded in size and time
    admission: Callable[[Tenant], AsyncContextManager]  # 429 beyond the requests in flight allowed
    grammars: GrammarCompiler  # checks structured-output grammars before dispatch
    tool_parser: ToolCallParser  # reads tool calls from an answer (tool_choice auto)


class OpenAIHandlers:
    """``/v1/completions`` and ``/v1/chat/completions`` over the gateway's ``HandlerServices``."""

    def __init__(self, services: HandlerServices):
        self.services = services

    # ---- request preparation ---------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.services.model_id:
            raise OpenAIError(404, f"The model '{model}' does not exist; this server serves '{self.services.model_id}'",
                              param="model", code="model_not_found")

    def _prepare(self, request: web.Request, kind: str, req, prompt_ids: list[int], plan: ToolPlan | None = None
                 ) -> Generation:
        model, options = req.model, req.sampling()
        self._check_model(model)
        services = self.services
        vocab = services.vocab_size
        if not prompt_ids:
            raise invalid("the prompt is empty after tokenization", "prompt")
        # Sizes before any per-token work: the length bounds the scan of the ids below.
        room = services.max_model_len - len(prompt_ids)
        max_tokens = options.max_tokens if options.max_tokens is not None else room
        if room < 1 or max_tokens > room:
            raise invalid(
                f"This model's maximum context length is {services.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded")
        if max(prompt_ids) >= vocab:  # ids are >= 0 (decoded so, or from the tokenizer)
            bad = next(t for t in prompt_ids if t >= vocab)
            raise invalid(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        # A top_k at or above the vocabulary keeps every token: clamp it (as vLLM does), so a huge
        # value never reaches the workers' messages.
        top_k = options.top_k if options.top_k is not None and options.top_k < vocab else 0
        for name, ids in (("logit_bias", [t for t, _ in options.logit_bias]), ("stop_token_ids", options.stop_token_ids)):
            if ids and max(ids) >= vocab:
                raise invalid(f"{name}: token id {max(ids)} is outside the vocabulary [0, {vocab})", name)
        # A built-in chat format's end-of-turn token ends a chat answer (unless EOS is ignored).
        turn_end = services.chat_format.stop_token_ids if kind == "chat" and not options.ignore_eos else ()
        params = SamplingParams(
            max_tokens=max_tokens, temperature=options.temperature, top_k=top_k,
            top_p=options.top_p, min_p=options.min_p, presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty, repetition_penalty=options.repetition_penalty,
            seed=options.seed, ignore_eos=options.ignore_eos, logprobs=options.logprobs,
            stop_token_ids=tuple(dict.fromkeys(turn_end + options.stop_token_ids)),
            # min_tokens beyond max_tokens: no stop token ends the output early (it ends at max_tokens)
            logit_bias=options.logit_bias, min_tokens=min(options.min_tokens, max_tokens),
            structured=options.structured or (plan.structured if plan else None),
        )
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        tenant = request["tenant"]
        salt = cache_salt(tenant, req.cache_salt, services.config.cache_isolation)
        gen = Generation(new_request_id(prefix), kind, model, prompt_ids, options, params, salt, tenant.key_id)
        if plan is not None and plan.parses_calls:
            gen.tools = ToolOutput(plan, services.tool_parser)
        return gen

    async def _check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar here first (cached by spec, off the event loop): one the
        backend refuses is a 400 naming its field before any worker sees it."""
        if params.structured is None:
            return
        try:
            await self.services.grammars.compile_async(params.structured)
        except GrammarError as exc:
            raise invalid(str(exc), params.structured.field, "invalid_grammar") from None

    def _chat_renderer(self, req, plan: ToolPlan):
        """A function applying the chat template (with the request's tools) and tokenizing (run
        inline or in a thread)."""
        tokenizer = self.services.tokenizer
        if self.services.chat_format.template is None:
            raise invalid(f"The model '{self.services.model_id}' has no chat template (it is a base model): use "
                          "/v1/completions, or start the gateway with --chat-template", "messages",
                          "chat_template_missing")
        messages = req.template_messages()
        tools = plan.template_tools()

        def render() -> list[int]:
            try:
                out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # a template may reject a role order, e.g. two system messages
                raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

        return messages, render

    # ---- endpoints -------------------------------------------------------------------------
    # Cheap checks first (body, JSON, model), then admission, then the tokenizer: a flood of large
    # prompts waits for slots (or gets 429) instead of keeping the tokenizer threads busy.

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.services.read_body(request)
        req = parse_completion_request(body, max_prompt_tokens=self.services.max_model_len)
        self._check_model(req.model)
        async with self.services.admission(request["tenant"]):
            ids = await self.services.prompts.text(req.prompt) if isinstance(req.prompt, str) else req.prompt
            gen = self._prepare(request, "completion", req, ids)
            await self._check_grammar(gen.params)
            return await self._serve(request, gen)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.services.read_body(request)
        req = parse_chat_request(body)
        self._check_model(req.model)
        plan = req.tool_plan()
        messages, render = self._chat_renderer(req, plan)
        async with self.services.admission(request["tenant"]):
            ids = await self.services.prompts.chat(messages, render)
            gen = self._prepare(request, "chat", req, ids, plan)
            await self._check_grammar(gen.params)
            return await self._serve(request, gen)

    # ---- generation ------------------------------------------------------------------------

    async def _serve(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        """Route, wait for the first token, then answer.  Everything up to the first token happens
        before any byte of the response, so a failure there is a real status code (503 +
        Retry-After, 400, 500), streaming or not; after it, a stream ends with an error event."""
        self.services.metrics.model(gen.model).prompt_tokens.inc(len(gen.prompt_ids))
        async with contextlib.aclosing(self._run(gen)) as run:
            first = await self._upstream(anext(run))
            if gen.options.stream:
                return await self._stream(request, gen, run, first)
            await self._upstream(_drain(run))
        return json_response(self._full_response(gen))

    @staticmethod
    async def _upstream(step):
        """Await one step of the generation, turning cluster outcomes into HTTP errors."""
        try:
            return await step
        except Saturated as exc:  # 503, or 429 when the API key holds its share of the wait queue
            if exc.status == 429:
                raise OpenAIError(429, str(exc), code="rate_limit_exceeded", retry_after=exc.retry_after) from None
            raise OpenAIError(exc.status, f"The server is saturated: {exc}", retry_after=exc.retry_after) from None
        except UpstreamError as exc:  # 500, or 502 when no worker gave a readable answer
            raise OpenAIError(exc.status, f"generation failed: {exc}", code="upstream_error") from None

    async def _run(self, gen: Generation):
        """Yield lists of ``(text_delta, frame)``, one list per batch of frames that arrived
        together, until the request finishes or a stop string ends it."""
        services = self.services
        metrics = services.metrics.model(gen.model)
        decoder = StreamingDecoder(services.tokenizer, gen.prompt_ids, gen.options.stop)
        result = DispatchResult()
        last = None
        try:
            stream = services.dispatcher.generate(gen.request_id, gen.prompt_ids, gen.params, result, gen.cache_salt,
                                                  gen.key_id)
            async with contextlib.aclosing(stream) as batches:
                async for batch in batches:
                    now_t = time.monotonic()
                    out = []
                    for frame in batch:
                        if last is None:
                            self._observe_first_frame(gen, frame, now_t - gen.arrival)
                        elif frame.token_ids:
                            metrics.inter_token_latency.observe(now_t - last)
                        last = now_t
                        gen.cached_tokens = max(gen.cached_tokens, frame.num_cached_tokens)
                        delta = decoder.step(frame.token_ids)
                        gen.token_ids.extend(frame.token_ids)
                        if frame.logprobs:
                            gen.logprobs.extend(frame.logprobs)
                        if decoder.stopped:
                            # Closing the frame generator below aborts the request on the workers.
                            gen.finish_reason, gen.stop_reason = "stop", decoder.matched_stop
                        elif frame.finished:
                            delta += decoder.finish()
                            gen.finish_reason = frame.finish_reason
                            if frame.num_preemptions and result.route:
                                decode_id = result.route.decode.worker_id
                                services.metrics.preemptions.labels(decode_id).inc(frame.num_preemptions)
                        gen.pieces.append(delta)
                        out.append((delta, frame))
                        if gen.finish_reason is not None:
                            break
                    yield out
                    if gen.finish_reason is not None:
                        return
        finally:
            metrics.generation_tokens.inc(len(gen.token_ids))
            metrics.e2e_request_latency.observe(time.monotonic() - gen.arrival)

    async def _stream(self, request: web.Request, gen: Generation, run, first) -> web.StreamResponse:
        """SSE from the first token on; a failure from here is an error event, then [DONE].

        Every write is bounded by ``client_write_timeout``: a client that stops reading is cut
        off, which ends the generation (the decode worker is told to abort, freeing its blocks)
        and frees the request's slot."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        request["outcome"] = "200"
        write = functools.partial(self._write, response)
        try:
            try:
                if gen.kind == "chat":
                    await write(sse_event(self._chat_chunk(gen, ChatDelta(role="assistant", content=""))))
                await self._write_batch(write, gen, first)
                async for batch in run:
                    await self._write_batch(write, gen, batch)
                if gen.options.include_usage:
                    await write(sse_event(self._usage_chunk(gen)))
                await write(SSE_DONE)
            except (Saturated, UpstreamError) as exc:
                request["outcome"] = "stream_error"
                await write(OpenAIError(exc.status, f"generation failed: {exc}").to_sse())
                await write(SSE_DONE)
            except ValueError as exc:
                request["outcome"] = "stream_error"
                await write(invalid(str(exc)).to_sse())
                await write(SSE_DONE)
        except _ClientTooSlow:
            request["outcome"] = "client_too_slow"
            # Else the listener's write deadline (the same bound, raced) cut it off, and counted it.
            if request.transport is not None and not request.transport.is_closing():
                self.services.metrics.client_write_timeouts.inc()
                log.info("request %s: the client took no data for %g s; cut off", gen.request_id,
                         self.services.config.client_write_timeout)
                request.transport.abort()  # drop what is buffered for it, now
        return response

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.services.config.client_write_timeout):
                await response.write(data)
        except TimeoutError:
            raise _ClientTooSlow() from None

    async def _write_batch(self, write, gen: Generation, batch: list[tuple[str, TokenFrame]]):
        """One write for a batch's SSE events (one event per frame that carries something)."""
        last = len(batch) - 1
        if gen.tools is not None:
            events = [sse_event(c) for i, (delta, frame) in enumerate(batch)
                      for c in self._tool_chunks(gen, delta, frame, final=i == last)]
        else:
            events = [sse_event(self._chunk(gen, delta, frame, final=i == last))
                      for i, (delta, frame) in enumerate(batch)
                      if delta or frame.logprobs or (i == last and gen.finish_reason is not None)]
        if events:
            await write(b"".join(events))

    def _tool_chunks(self, gen: Generation, delta: str, frame: TokenFrame, final: bool) -> list[ChatCompletionChunk]:
        """A chat frame's chunks when the answer may hold tool calls (gateway/tool_output.py)."""
        deltas = gen.tools.step(delta)
        ending = final and gen.finish_reason is not None
        if ending:
            deltas += gen.tools.finish()
        if not deltas and (frame.logprobs or ending):
            deltas = [ChatDelta()]
        logprobs = self._chat_logprobs(frame.logprobs)
        chunks = []
        for i, d in enumerate(deltas):
            last = ending and i == len(deltas) - 1
            finish = self._finish_reason(gen) if last else None
            choice = ChatStreamChoice(0, d, logprobs if i == 0 else None, finish, gen.stop_reason if last else None)
            chunks.append(ChatCompletionChunk(gen.request_id, now(), gen.model, [choice]))
        return chunks

    @staticmethod
    def _finish_reason(gen: Generation) -> str | None:
        """``tool_calls`` for an answer that ended in tool calls (OpenAI's), else the engine's."""
        if gen.tools is not None and gen.tools.made_calls and gen.finish_reason == "stop":
            return "tool_calls"
        return gen.finish_reason

    # ---- response shapes -------------------------------------------------------------------

    def _observe_first_frame(self, gen: Generation, frame: TokenFrame, ttft: float) -> None:
        metrics = self.services.metrics
        model = metrics.model(gen.model)
        model.time_to_first_token.observe(ttft)
        model.prefix_cache_hit_tokens.inc(frame.num_cached_tokens)
        if frame.kv_transfer_bytes:
            metrics.kv_transfer_bytes.inc(frame.kv_transfer_bytes)
            metrics.kv_transfer_seconds.observe(frame.kv_transfer_seconds)
        if frame.prefill_fallback:
            metrics.kv_transfer_failures.labels("remote_prefill_failed").inc()

    def _token_text(self, token_id: int) -> str:
        return self.services.tokenizer.decode([token_id])

    def _completion_logprobs(self, entries, offset: int) -> CompletionLogprobs | None:
        if not entries:
            return None
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self._token_text(t): lp for t, lp in e.top} for e in entries], text_offset=offsets,
        )

    def _chat_logprobs(self, entries) -> ChatLogprobs | None:
        if not entries:
            return None
        out = []
        for e in entries:
            token = self._token_text(e.token_id)
            top = [TopLogprob(self._token_text(t), lp, list(self._token_text(t).encode())) for t, lp in e.top]
            out.append(ChatTokenLogprob(token, e.logprob, list(token.encode()), top))
        return ChatLogprobs(content=out)

    def _usage(self, gen: Generation) -> Usage:
        return Usage.of(len(gen.prompt_ids), len(gen.token_ids), gen.cached_tokens)

    def _chunk(self, gen: Generation, delta: str, frame: TokenFrame, final: bool = True):
        """The chunk of one frame; ``final``: the last frame so far (it carries the finish reason)."""
        finish = gen.finish_reason if final else None
        if gen.kind == "chat":
            choice = ChatStreamChoice(0, ChatDelta(content=delta) if delta else ChatDelta(),
                                      self._chat_logprobs(frame.logprobs), finish, gen.stop_reason if final else None)
            return ChatCompletionChunk(gen.request_id, now(), gen.model, [choice])
        choice = CompletionChoice(0, delta, self._completion_logprobs(frame.logprobs, 0), finish,
                                  gen.stop_reason if final else None)
        return CompletionChunk(gen.request_id, now(), gen.model, [choice])

    def _chat_chunk(self, gen: Generation, delta: ChatDelta):
        return ChatCompletionChunk(gen.request_id, now(), gen.model, [ChatStreamChoice(0, delta)])

    def _usage_chunk(self, gen: Generation):
        if gen.kind == "chat":
            return ChatCompletionChunk(gen.request_id, now(), gen.model, [], self._usage(gen))
        return CompletionChunk(gen.request_id, now(), gen.model, [], self._usage(gen))

    def _full_response(self, gen: Generation):
        if gen.kind == "chat":
            message, finish = ChatResponseMessage(gen.text), gen.finish_reason
            if gen.tools is not None:
                content, calls = gen.tools.final(gen.text)
                message = ChatResponseMessage(content, tool_calls=gen.tools.message_calls(calls))
                if calls and finish == "stop":
                    finish = "tool_calls"
            choice = ChatChoice(0, message, self._chat_logprobs(gen.logprobs), finish, gen.stop_reason)
            return ChatCompletionResponse(gen.request_id, now(), gen.model, [choice], self._usage(gen))
        choice = CompletionChoice(0, gen.text, self._completion_logprobs(gen.logprobs, 0), gen.finish_reason,
                                  gen.stop_reason)
        return CompletionResponse(gen.request_id, now(), gen.model, [choice], self._usage(gen))
