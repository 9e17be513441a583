"""POST /prefill: compute a prompt in chunks, ship its KV as the chunks complete, return the first token.

A moved stream (``PrefillRequest.resume_token_ids``) is computed as its new decode worker will hold
it: the prompt and the outputs already streamed, and the token after them.  Asked of the draining
worker the stream left (``moved_stream_id``: a live KV move), that worker's prefix cache still
holds the stream's full blocks, so only the last partial block is computed before they ship; it
takes such a call in any role and while it drains, and its drain waits for it."""
from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from common.cluster.messages import PrefillRequest, PrefillResult, decode, encode, wire_logprob, wire_logprobs
from prefill_svc.request_checks import check_prefill_request
from prefill_svc.shipping import Shipper, ShippingJob, ship, unpin_leftovers
from worker.role_context import RoleContext

log = logging.getLogger(__name__)


async def _first_output(stream: asyncio.Queue, shipping: asyncio.Task):
    """The request's first output, unless shipping fails first (a dead receiver stops the prefill)."""
    getter = asyncio.ensure_future(stream.get())
    try:
        await asyncio.wait({getter, shipping}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done() and shipping.done() and not shipping.cancelled() and (
                shipping.exception() is None or getattr(shipping.exception(), "with_output", False)):
            # Every block went out, or the request ended with an error (its output was posted in
            # the step that ended it), before this handler saw the output: it is on its way.
            await getter
    finally:
        if not getter.done():
            getter.cancel()
    if not getter.done() or getter.cancelled():
        shipping.result()  # raises the transfer error
        raise RuntimeError("shipping ended before the prompt was computed")
    output = getter.result()
    if isinstance(output, BaseException):
        raise output
    return output


def _reply(result: PrefillResult, status: int = 200) -> web.Response:
    return web.Response(body=encode(result), status=status, content_type="application/msgpack")


async def handle_prefill(context: RoleContext, shipper: Shipper, request: web.Request) -> web.Response:
    try:
        body = decode(await request.read(), PrefillRequest)
    except ValueError as exc:
        return _reply(PrefillResult(error=str(exc)), 400)
    refusal = context.accepts("export" if body.moved_stream_id else "prefill")
    if refusal:
        return _reply(PrefillResult(error=refusal[1]), 503)
    try:
        kv_address = check_prefill_request(
            body, await context.peers.get(body.decode_worker_id), vocab_size=context.model.vocab_size,
            block_size=context.model.block_size, transport=context.config.kv.transport)
    except ValueError as exc:
        return _reply(PrefillResult(error=f"invalid PrefillRequest: {exc}"), 400)
    # Again after the lookup: a drain that began meanwhile found nothing in flight, and said idle.
    if refusal := context.accepts("export" if body.moved_stream_id else "prefill"):
        return _reply(PrefillResult(error=refusal[1]), 503)
    try:
        context.in_flight.track(body.request_id)
    except ValueError as exc:
        return _reply(PrefillResult(error=str(exc)), 409)
    request_id = body.request_id
    loop = asyncio.get_running_loop()
    job = ShippingJob(request_id, body.transfer_id, kv_address, body.dst_block_ids, body.num_skip_blocks, loop)
    stream = context.engine.open_stream(request_id)
    shipping: asyncio.Task | None = None
    outcome = "error"
    # The prefill computes the prompt and samples its first token with the request's own
    # parameters (seeded sampling depends only on seed and position, so the decode side continues
    # the same sequence); the decode worker applies max_tokens and stop rules.  A moved stream
    # samples the token after its outputs so far.
    sampled = len(body.resume_token_ids) + 1
    params = msgspec.structs.replace(body.sampling_params, max_tokens=sampled,
                                     min_tokens=min(body.sampling_params.min_tokens, sampled))

    try:
        # The first token obeys the request's grammar: it is compiled here too (cached by spec).
        grammar = await context.compile_grammar(params)

        def start(engine):
            shipper.start(engine, job, engine.make_request(body.prompt_token_ids, params, request_id, body.cache_salt,
                                                           grammar, body.resume_token_ids))

        await context.engine.call(start)
        shipping = asyncio.create_task(ship(context, job))
        output = await _first_output(stream, shipping)
        if output.error is not None:  # its grammar failed (the decode worker then computes it, and says why)
            outcome = "invalid"
            return _reply(PrefillResult(error=output.error), 422)
        num_sent = await shipping
        computed = job.num_kv_tokens - output.num_cached_tokens  # a moved stream's outputs count too
        context.metrics.prefill_computed_tokens.inc(computed)
        context.metrics.prefill_cached_tokens.inc(output.num_cached_tokens)
        context.metrics.kv_sent_bytes.inc(num_sent * context.model.block_nbytes)
        if body.moved_stream_id:
            context.metrics.moved_blocks.inc(num_sent)
        outcome = "ok"
        return _reply(PrefillResult(
            first_token_id=output.new_token_ids[0],
            first_logprob=wire_logprob(output.new_logprobs[0] if output.new_logprobs else None),
            prompt_logprobs=wire_logprobs(output.prompt_logprobs),
            num_cached_tokens=output.num_cached_tokens, num_sent_blocks=num_sent,
        ))
    except asyncio.CancelledError:
        outcome = "aborted"
        raise
    except ValueError as exc:
        outcome = "invalid"
        return _reply(PrefillResult(error=str(exc)), 400)
    except Exception as exc:
        log.warning("prefill of %s failed: %s: %s", request_id, type(exc).__name__, exc)
        context.metrics.kv_transfer_failures.inc()
        return _reply(PrefillResult(error=f"{type(exc).__name__}: {exc}"), 502)
    finally:
        if shipping is not None and not shipping.done():
            shipping.cancel()
        context.engine.close_stream(request_id)
        context.metrics.requests.labels("prefill", outcome).inc()
        context.in_flight.finish(request_id, lambda e: shipper.stop(e, request_id), then=unpin_leftovers(context, job))
        if body.moved_stream_id:
            context.exported(body.moved_stream_id)
