"""The OpenAI endpoints: validate, tokenize, dispatch, detokenize, answer (JSON or SSE)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncContextManager, Awaitable, Callable

import msgspec
from aiohttp import web

from common.cluster.messages import TokenFrame
from common.engine.sampling_params import SamplingParams, check_prompt_logprobs
from common.engine.structured.backend import GrammarError
from common.engine.structured.compiler import CompilerBusy
from common.engine.structured.compiler import GrammarCompiler
from gateway.chat_template import ChatFormat
from gateway.config import GatewayConfig
from gateway.detokenizer import StreamingDecoder
from gateway.engine_params import engine_params
from gateway.request_extensions import added_bos, answer_id, echoed_prompt, truncated
from gateway.dispatch import Dispatcher, Saturated, UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptEncoder
from gateway.template_kwargs import check_not_parameters
from gateway.tenants import Tenant, cache_salt
from gateway.generation import Generation
from gateway.messages_output import MessagesAnswer
from gateway.messages_request import parse_messages_request
from gateway.response_shapes import Answer, AnswerStream, ChoicesStream, ResponseShapes, prompt_tokens
from gateway.background_responses import BackgroundResponses
from gateway.conversation_store import ConversationStore
from gateway.response_store import ResponseStore
from gateway.responses_endpoints import ResponsesEndpoints
from gateway.tool_output import ToolOutput
from gateway.tool_parsers import ToolCallParser
from gateway.tools_request import ToolPlan
from gateway.openai_errors import as_invalid, check_model
from gateway.openai_protocol import (
    SSE_HEADERS, ChatCompletionRequest, OpenAIError, invalid, json_response, new_request_id, parse_chat_request,
    parse_completion_request,
)

log = logging.getLogger(__name__)
MAX_TEMPLATE_ERROR = 500  # characters of a chat template's error in a 400


class _ClientTooSlow(Exception):
    """The client accepted no bytes for ``client_write_timeout`` seconds."""


def _check_scores(gens: list[Generation]) -> None:
    """Every choice scores its prompt (echo with logprobs, ``prompt_logprobs``): the request's scores
    in all are bounded (400 naming the field that asked)."""
    options = gens[0].options
    try:
        check_prompt_logprobs(sum(len(g.prompt_ids) for g in gens), gens[0].params.prompt_logprobs)
    except ValueError as exc:
        field = "prompt_logprobs" if options.prompt_logprobs is not None else "logprobs"
        raise invalid(f"{field}: {exc}", field) from None


async def _drain(run) -> None:
    async for _ in run:
        pass


async def _merge(gens: list[Generation], runs: list):
    """``(generation, batch)`` from every run, as they arrive, after the first run's first batch
    (already read).  One run is read directly; several are pumped by tasks into a small queue (it
    holds a few batches: a slow client still holds the workers back)."""
    if len(runs) == 1:
        async for batch in runs[0]:
            yield gens[0], batch
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(runs))
    done = object()

    async def pump(gen: Generation, run) -> None:
        try:
            async for batch in run:
                await queue.put((gen, batch))
            await queue.put((gen, done))
        except Exception as exc:
            await queue.put((gen, exc))

    tasks = [asyncio.create_task(pump(g, r)) for g, r in zip(gens, runs)]
    try:
        running = len(tasks)
        while running:
            gen, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield gen, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    response_store: ResponseStore | None  # the Responses API's stored responses (None: none stored)
    background: BackgroundResponses | None  # the background responses this gateway runs (where stored)
    conversations: ConversationStore | None = None  # the Responses API's conversations (where responses are stored)


class OpenAIHandlers(ResponsesEndpoints):
    """``/v1/completions``, ``/v1/chat/completions``, Anthropic's ``/v1/messages`` and the Responses API
    (gateway/responses_endpoints.py) over the gateway's ``HandlerServices``."""

    def __init__(self, services: HandlerServices):
        self.services = services
        self.shapes = ResponseShapes(services.tokenizer)
        self.special_ids = frozenset(getattr(services.tokenizer, "all_special_ids", ()))  # (EOS among them)

    # ---- request preparation ---------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        check_model(model, self.services.model_id)

    def _prepare(self, request: web.Request, kind: str, req, prompt_ids: list[int], plan: ToolPlan | None = None,
                 echo: str = "", response_id: str | None = None, prompt_index: int = 0,
                 cluster_id: str | None = None, bound_field: str | None = None) -> list[Generation]:
        """A prompt's ``n`` generations.  With a seed, choice ``i`` is seeded ``seed + i``: each
        is reproducible, and they differ.  A batch's prompt ``prompt_index`` (``response_id``: the
        batch's) has the choices ``prompt_index * n + i``.  ``cluster_id``: what names them to the
        workers and in logs where the client's id is a secret (a stored response's); else that id.
        ``bound_field``: the API's name for the bound on the output's tokens (else the request's)."""
        model, options = req.model, req.sampling()
        self._check_model(model)
        services = self.services
        params, echo_only = engine_params(options, kind, kind == "completion" and req.echo, prompt_ids, plan,
                                          max_model_len=services.max_model_len, vocab_size=services.vocab_size,
                                          turn_end=services.chat_format.stop_token_ids,
                                          bound_field=bound_field or req.output_bound_field())
        tenant = request["tenant"]
        salt = cache_salt(tenant, req.cache_salt, services.config.cache_isolation)
        response_id = response_id or new_request_id("cmpl" if kind == "completion" else "chatcmpl")
        cluster_id = cluster_id or response_id
        n = options.best_of or req.n  # (best_of: its candidates, the best n answered)
        choices = n * (len(req.prompt) if kind == "completion" else 1)
        gens, running = [], [n]  # (its choices not ended, shared)
        for i in range(n):
            seeded = params if i == 0 or params.seed is None else msgspec.structs.replace(
                params, seed=(params.seed + i + 2**63) % 2**64 - 2**63)  # stays a signed 64-bit integer
            index = prompt_index * n + i
            gen = Generation(cluster_id if choices == 1 else f"{cluster_id}-{index}", kind, model, prompt_ids,
                             options, seeded, salt, tenant.key_id, index=index, first_choice=i == 0,
                             response_id=response_id, cluster_request=cluster_id, echo=echo, echo_only=echo_only,
                             running=running)
            if plan is not None and plan.parses_calls:
                gen.tools = ToolOutput(plan, services.tool_parser)
            gens.append(gen)
        return gens

    async def _check_grammar(self, params: SamplingParams, plan: ToolPlan | None = None) -> None:
        """Compile the request's grammar here first (cached by spec, off the event loop): one the backend refuses
        is a 400 naming its field before any worker sees it (compile threads busy: a 503).  So are the tools'
        parameters, as their calls' arguments, whatever ``tool_choice`` says (as OpenAI's API)."""
        specs = [] if params.structured is None else [params.structured]
        if plan is not None and plan.mode != "required":  # (required's grammar holds every tool's)
            specs += plan.argument_grammars(but=plan.function)  # (a named one's is the request's)
        for spec in specs:
            try:
                await self.services.grammars.compile_async(spec)
            except (GrammarError, CompilerBusy) as exc:  # (busy: others' grammars held the threads, not a bad one)
                raise (invalid(str(exc), spec.field, "invalid_grammar") if isinstance(exc, GrammarError) else
                       OpenAIError(503, str(exc), param=spec.field, code="grammar_compiler_busy")) from None

    def _chat_renderer(self, req: ChatCompletionRequest, plan: ToolPlan, field: str = "messages"):
        """A function applying the chat template (with the request's tools, its generation prompt or
        its last message left open, its template variables) and tokenizing (run inline or in a
        thread); its 400s name ``field`` (where the messages came from)."""
        tokenizer = self.services.tokenizer
        if self.services.chat_format.template is None:
            raise invalid(f"The model '{self.services.model_id}' has no chat template (it is a base model): use "
                          "/v1/completions, or start the gateway with --chat-template", field,
                          "chat_template_missing")
        messages = req.template_messages()
        tools = plan.template_tools()
        check_not_parameters(req.chat_template_kwargs, tokenizer.apply_chat_template)

        def render() -> list[int]:
            try:
                extra = {"continue_final_message": True} if req.continue_final_message else {}
                text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **extra,
                                                     add_generation_prompt=req.add_generation_prompt
                                                     and not req.continue_final_message,
                                                     **(req.chat_template_kwargs or {}))
            except Exception as exc:  # a template may reject a role order, e.g. two system messages
                # (cut: transformers' own messages may quote the whole rendered conversation)
                raise invalid(f"the chat template rejected the messages: {str(exc)[:MAX_TEMPLATE_ERROR]}",
                              field) from None
            # What the template made of the messages is bounded like a prompt, before it is tokenized
            # (unless it is to be truncated: then by the body's bound only).
            if req.truncate_prompt_tokens is None:
                self.services.prompts.check_size(len(text), len(text.encode("utf-8", "surrogatepass")), field)
            return list(tokenizer(text, add_special_tokens=bool(req.add_special_tokens)).input_ids)

        return messages, render

    # ---- endpoints -------------------------------------------------------------------------
    # Cheap checks first (body, JSON, model), then admission, then the tokenizer: a flood of large
    # prompts waits for slots (or gets 429) instead of keeping the tokenizer threads busy.

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.services.read_body(request)
        req = parse_completion_request(body, max_prompt_tokens=self.services.max_model_len)
        self._check_model(req.model)
        named = answer_id(request.headers, req, "cmpl")  # (the workers see an id of the gateway's)
        async with self.services.admission(request["tenant"]):
            response_id, cluster_id, gens = named or new_request_id("cmpl"), named and new_request_id("cmpl"), []
            for index, prompt in enumerate(req.prompt):
                whole = (await self.services.prompts.text(prompt, add_special_tokens=req.add_special_tokens is not False,
                                                          bounded=req.truncate_prompt_tokens is None)
                         if isinstance(prompt, str) else prompt)
                lead = added_bos(self.services.tokenizer, prompt, whole)
                ids = truncated(whole, req.truncate_prompt_tokens, self.services.max_model_len, req.max_tokens, lead)
                echo = echoed_prompt(self.services.tokenizer, prompt, whole, ids, lead) if req.echo else ""
                gens += self._prepare(request, "completion", req, ids, echo=echo, response_id=response_id,
                                      prompt_index=index, cluster_id=cluster_id)
            _check_scores(gens)
            await self._check_grammar(gens[0].params)
            return await self._serve(request, gens)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.services.read_body(request)
        req = parse_chat_request(body)
        self._check_model(req.model)
        plan = req.tool_plan()
        messages, render = self._chat_renderer(req, plan)
        named = answer_id(request.headers, req, "chatcmpl")  # (the workers see an id of the gateway's)
        async with self.services.admission(request["tenant"]):
            ids = truncated(await self.services.prompts.chat(messages, render, bounded=req.truncate_prompt_tokens is None),
                            req.truncate_prompt_tokens, self.services.max_model_len,
                            req.max_completion_tokens or req.max_tokens)
            gens = self._prepare(request, "chat", req, ids, plan, response_id=named,
                                 cluster_id=named and new_request_id("chatcmpl"))
            _check_scores(gens)
            await self._check_grammar(gens[0].params, plan)
            return await self._serve(request, gens)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: a chat request in that API's shapes (gateway/messages_request.py,
        gateway/messages_output.py)."""
        req = parse_messages_request(await self.services.read_body(request))
        return await self._chat_answered_as(request, req, MessagesAnswer(), "messages")

    async def _chat_answered_as(self, request: web.Request, req: ChatCompletionRequest, answer: Answer,
                                field: str) -> web.StreamResponse:
        """A chat request (another API's, read into the chat's) answered in ``answer``'s shape, its id
        the answer's; the template's refusals name ``field``."""
        self._check_model(req.model)
        async with self.services.admission(request["tenant"]):
            return await self._chat_admitted(request, req, answer, field)

    async def _chat_admitted(self, request: web.Request, req: ChatCompletionRequest, answer: Answer,
                             field: str) -> web.StreamResponse:
        """``_chat_answered_as`` once the request is admitted."""
        return await self._serve(request, await self._chat_generations(request, req, answer, field), answer)

    async def _chat_generations(self, request: web.Request, req: ChatCompletionRequest, answer: Answer,
                                field: str) -> list[Generation]:
        """An admitted chat request's generation (another API's: its id ``answer``'s), checked."""
        plan = req.tool_plan()
        messages, render = self._chat_renderer(req, plan, field=field)
        ids = await self.services.prompts.chat(messages, render)
        # (a stored response's id reads it where there are no API keys: the workers and logs see another)
        try:
            gens = self._prepare(request, "chat", req, ids, plan, response_id=answer.response_id,
                                 cluster_id=new_request_id("chatcmpl"), bound_field=answer.max_tokens_field)
        except OpenAIError as exc:  # (named as this API names its messages)
            exc.param = field if exc.param == "messages" else exc.param
            raise
        await self._check_grammar(gens[0].params, plan)
        return gens

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``/v1/messages/count_tokens``: the prompt's tokens as the chat template makes them."""
        body = await self.services.read_body(request)
        req = parse_messages_request(body, counting=True)
        self._check_model(req.model)
        messages, render = self._chat_renderer(req, req.tool_plan())
        async with self.services.admission(request["tenant"]):
            ids = await self.services.prompts.chat(messages, render)
        return web.json_response({"input_tokens": len(ids)})

    # ---- generation ------------------------------------------------------------------------

    async def _serve(self, request: web.Request, gens: list[Generation],
                     answer: Answer | None = None) -> web.StreamResponse:
        """Route, wait for the first token, then answer.  Everything up to the first token happens
        before any byte of the response, so a failure there is a real status code (503 +
        Retry-After, 400, 500), streaming or not; after it, a stream ends with an error event.

        With ``n > 1`` the first choice goes first; once its first token is out (its prompt is in
        its decode worker's prefix cache) the others start on that worker, where they find the
        prompt's blocks and share them instead of computing it again.  A batch's other prompts start
        then too, their choices each on its own (a prompt's first has yet to compute it).
        ``answer``: another API's shape (the Responses or Messages API's; None: the choices' of
        completions and chat)."""
        for gen in gens[1:]:  # (a batch's prompts were tokenized one after another)
            gen.created = gens[0].created
        if not gens[0].options.stream:
            return json_response(await self._whole(gens, answer))
        async with contextlib.AsyncExitStack() as stack:
            first, rest = await self._started(stack, gens)
            events = answer.stream(gens[0]) if answer is not None else ChoicesStream(self.shapes, gens)
            return await self._stream(request, gens, rest, first, events)

    async def _whole(self, gens: list[Generation], answer: Answer | None = None,
                     on_first: Callable[[], None] = lambda: None) -> Any:
        """The generations run to their end, answered whole (in ``answer``'s shape, kept where its API
        keeps answers; ``on_first`` told of the first token); cluster outcomes raise ``OpenAIError``."""
        async with contextlib.AsyncExitStack() as stack:
            _, rest = await self._started(stack, gens)
            on_first()
            await self._upstream(_drain(rest))
        if answer is None:
            return self.shapes.full_response(gens)
        whole = answer.whole(gens)
        await answer.keep(whole)
        return whole

    async def _started(self, stack: contextlib.AsyncExitStack, gens: list[Generation]):
        """Every generation started (closed with ``stack``), as ``_serve`` tells: the first choice's
        first batch, and every later batch of them all."""
        self.services.metrics.model(gens[0].model).prompt_tokens.inc(prompt_tokens(gens))
        for gen in gens:  # (run last: a run closed before it began never counted itself out)
            stack.callback(self._ended, gen)
        runs = [await stack.enter_async_context(contextlib.aclosing(self._run(gens[0])))]
        first = await self._upstream(anext(runs[0]))
        sibling = True
        for gen in gens[1:]:
            sibling = sibling and not gen.first_choice  # prompt 0's other choices come right after it
            follow = gens[0] if sibling else None
            runs.append(await stack.enter_async_context(contextlib.aclosing(self._run(gen, follow=follow))))
        return first, await stack.enter_async_context(contextlib.aclosing(_merge(gens, runs)))

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

    async def _run(self, gen: Generation, follow: Generation | None = None):
        """Yield lists of ``(text_delta, frame)``, one list per batch of frames that arrived
        together, until the request finishes or a stop string ends it.  ``follow``: go to the
        decode worker that generation went to (it holds the prompt), if it can take it."""
        services = self.services
        metrics = services.metrics.model(gen.model)
        decoder = StreamingDecoder(services.tokenizer, gen.prompt_ids, gen.options.stop,
                                   skip_special_tokens=gen.options.skip_special_tokens,
                                   include_stop=gen.options.include_stop, min_tokens=gen.options.min_tokens)
        result = gen.dispatch
        last = None
        try:
            stream = services.dispatcher.generate(gen.request_id, gen.prompt_ids, gen.params, result, gen.cache_salt,
                                                  gen.key_id, follow=follow.dispatch if follow else None,
                                                  choice_of=gen.cluster_request)
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
                        if frame.prompt_logprobs is not None and gen.prompt_logprobs is None:
                            gen.prompt_logprobs = frame.prompt_logprobs
                        shown = frame.token_ids
                        if (ending := gen.ending_token(frame, self.special_ids)) is not None:  # (vLLM's)
                            shown = shown if gen.options.include_stop else shown[:-1]
                            gen.stop_reason = ending if ending in gen.options.stop_token_ids else None
                        delta = decoder.step(shown)
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
            self._ended(gen)

    def _ended(self, gen: Generation) -> None:
        """Count ``gen`` out of its prompt's running choices, once (its run's end, or its never starting)."""
        if gen.ended:
            return
        gen.ended = True
        metrics = self.services.metrics.model(gen.model)
        metrics.generation_tokens.inc(len(gen.token_ids))
        gen.running[0] -= 1
        if not gen.running[0]:  # once a prompt, as its last choice ends (``_observe_first_frame``)
            metrics.e2e_request_latency.observe(time.monotonic() - gen.arrival)

    async def _stream(self, request: web.Request, gens: list[Generation], rest, first,
                      events: AnswerStream) -> web.StreamResponse:
        """SSE from the first token on (``events`` shapes them); a failure from here is an error
        event (then [DONE]; the Responses API's ``response.failed``, the Messages API's ``error``).

        Every write is bounded by ``client_write_timeout``: a client that stops reading is cut
        off, which ends the generation (the decode worker is told to abort, freeing its blocks)
        and frees the request's slot."""
        gen = gens[0]
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        request["outcome"] = "200"
        write = functools.partial(self._write, response)
        try:
            try:
                if data := events.opening() + events.batch(gen, first):
                    await write(data)
                async for sibling, batch in rest:
                    if data := events.batch(sibling, batch):
                        await write(data)
                await events.keep()
                await write(events.closing())
            except (Saturated, UpstreamError) as exc:
                request["outcome"] = "stream_error"
                await write(events.failure(OpenAIError(exc.status, f"generation failed: {exc}")))
            except ValueError as exc:
                request["outcome"] = "stream_error"
                await write(events.failure(as_invalid(exc)))
        except ConnectionResetError:  # the client left before aiohttp cancelled this handler: not an error
            request["outcome"] = "client_disconnected"
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

    # ---- metrics ---------------------------------------------------------------------------

    def _observe_first_frame(self, gen: Generation, frame: TokenFrame, ttft: float) -> None:
        metrics = self.services.metrics
        model = metrics.model(gen.model)
        if gen.first_choice:  # once a prompt, as its tokens are counted (n > 1: the others find its blocks)
            model.time_to_first_token.observe(ttft)
            model.prefix_cache_hit_tokens.inc(frame.num_cached_tokens)
        if frame.kv_transfer_bytes:
            metrics.kv_transfer_bytes.inc(frame.kv_transfer_bytes)
            metrics.kv_transfer_seconds.observe(frame.kv_transfer_seconds)
        if frame.prefill_fallback:
            metrics.kv_transfer_failures.labels("remote_prefill_failed").inc()
