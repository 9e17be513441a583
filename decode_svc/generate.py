"""POST /generate: one request on a decode worker, streamed back as TokenFrames.

    reserve blocks for the prompt (minus what this worker already caches)      -- decode allocates first
        no room (or reservations hold their budget): answer 503 "busy" before anything streams,
        and the gateway tries another decode worker
    expect KV into them, and ask the prefill worker to compute and ship it     -- in parallel
    KV complete                ->  the reservation's lease stops: landed KV is never taken for late
    KV complete + first token  ->  the first token goes out; the request joins the running batch
                                   between two engine steps
    every step's new token     ->  TokenFrame to the gateway
    a failure of the prefill worker or the transfer before the first token: compute the prompt
        locally instead
    a stream moved here (``resume_token_ids``): the KV of the prompt and those tokens comes from
        ``prefill_worker_id`` -- the draining worker it left, out of its cache -- or is computed
        here; go on after them
    this worker drains (``HandOver``, for a request that ``may_migrate``): after the tokens sent so
        far, a "migrate" frame; the gateway continues the stream on another worker
    client gone / abort, or the lease ended before the KV landed: tell the prefill worker; free the
        blocks once no KV can land in them
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from common.engine.engine import Engine, RequestOutput, StepFailed
from common.engine.request import Request, RequestStatus, grammar_verdict, status_after_token
from common.engine.structured.backend import CompiledGrammar
from common.engine.structured.compiler import CompilerBusy
from worker.engine_thread import MOVE_SOON, EngineFailed, HandOver
from common.cluster.registry import WorkerInfo
from common.cluster.messages import (
    FRAMES_CONTENT_TYPE, GenerateRequest, PrefillRequest, TokenFrame, TokenLogprob, decode, frame, wire_logprobs,
)
from decode_svc.prefill_client import BadPrefillAnswer, call_prefill_while_listed, resolve_prefill_worker, send_abort
from kvtransfer.receiver import IncomingTransfer, TransferResult
from worker.role_context import RoleContext

log = logging.getLogger(__name__)


class GrammarFailed(ValueError):
    """The request's grammar could not be followed (``RequestOutput.error``): the client's error."""


class RemotePrefillFailed(Exception):
    """The prefill worker or the KV transfer failed; nothing has been streamed yet."""


class LeaseEnded(Exception):
    """The reservation's lease ended before its KV landed: the KV is late and refused, and the
    request is given up as for any expired lease (``Worker._leases_expired``)."""


class OpenStream:
    """Whether this handler's stream has sent a token; counted in the worker's ``streams_open``
    from then until it ends (what a drain or a crash would move)."""

    def __init__(self, gauge):
        self.gauge, self.started = gauge, False

    def first_token(self) -> None:
        if not self.started:
            self.started = True
            self.gauge.inc()

    def close(self) -> None:
        if self.started:
            self.gauge.dec()


class PendingRelease:
    """What must end before a request's blocks may be freed: set when its KV transfer was
    abandoned (``release`` frees the blocks itself once the transfer has settled)."""

    def __init__(self):
        self.release: asyncio.Task | None = None


def _logprobs(output: RequestOutput) -> list[TokenLogprob] | None:
    if not output.new_logprobs or output.new_logprobs[0] is None:
        return None
    return wire_logprobs([lp for lp in output.new_logprobs if lp is not None])


def output_frame(output: RequestOutput) -> TokenFrame:
    return TokenFrame(
        token_ids=output.new_token_ids, logprobs=_logprobs(output), prompt_logprobs=wire_logprobs(output.prompt_logprobs),
        finished=output.finished, finish_reason=output.finish_reason, num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens, num_preemptions=output.num_preemptions,
    )


async def handle_generate(context: RoleContext, request: web.Request) -> web.StreamResponse:
    try:
        body = decode(await request.read(), GenerateRequest)
    except ValueError as exc:
        return error_answer(str(exc), "invalid", 400)
    refusal = context.accepts("last_resort" if body.last_resort and body.resume_token_ids else "generate")
    if refusal:
        error_kind, reason = refusal
        return error_answer(reason, error_kind, 503)
    try:
        context.in_flight.track(body.request_id)
    except ValueError as exc:
        return error_answer(str(exc), "invalid", 409)
    if body.may_migrate:  # from now on a drain hands it over (before any await: no drain slips between)
        context.movable_streams.add(body.request_id)
    response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
    stream = context.engine.open_stream(body.request_id)
    started = time.monotonic()
    opened = OpenStream(context.metrics.streams_open)
    outcome = "error"
    pending = PendingRelease()
    try:
        first = None
        fallback = False
        reservation = None
        grammar = await context.compile_grammar(body.sampling_params)
        try:
            if body.prefill_worker_id:
                reservation = await reserve(context, body, grammar)
                if reservation is None:  # nothing started: the gateway tries another decode worker
                    outcome = "busy"
                    return error_answer("no free KV blocks to reserve for the prompt right now", "busy", 503)
            await response.prepare(request)
            if reservation is not None:
                first = await remote_prefill(context, body, reservation, pending)
        except RemotePrefillFailed as exc:
            fallback = True
            context.metrics.prefill_fallbacks.inc()
            log.warning("request %s: remote prefill failed (%s); computing the prompt locally", body.request_id, exc)
            await response.prepare(request)
        if first is None:
            await add_local(context, body, grammar)
        elif first.finished:  # the first token ends it: land it (its blocks become cache), then answer
            await land(context, body.request_id, first.token_ids[0])
            context.ttft.add(time.monotonic() - started)
            await response.write(frame(first))
            outcome = first.finish_reason or "stop"
            return response
        else:
            # The first token goes out now, not after the engine's step in flight (a colocated
            # worker's step may carry a long prompt chunk); the request joins the batch after it.
            context.ttft.add(time.monotonic() - started)
            opened.first_token()
            await response.write(frame(first))
            try:
                await land(context, body.request_id, first.token_ids[0])
            except EngineFailed as exc:
                raise RuntimeError(str(exc)) from None  # mid-stream: the request cannot move any more
        outcome = await stream_outputs(context, stream, response, started, opened, fallback)
    except asyncio.CancelledError:
        outcome = "aborted"
        raise
    except HandOver as exc:  # this worker drains: the gateway continues the stream elsewhere
        outcome = "migrated"
        context.metrics.streams_handed_over.inc()
        return await _error(response, str(exc), "migrate", 503)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        outcome = "client_gone"
    except CompilerBusy as exc:  # others' grammars held the compile threads: another worker may take it
        outcome = "busy"
        return await _error(response, str(exc), "busy", 503)
    except ValueError as exc:  # rejected by the engine: bad sampling params, too long, a bad grammar ...
        outcome = "invalid"
        spec = body.sampling_params.structured
        param = spec.field if isinstance(exc, GrammarFailed) and spec is not None else None
        return await _error(response, str(exc), "invalid", 400, param)
    except StepFailed as exc:  # this request was in a step that failed: an explicit error, not retried
        outcome = "failed"
        return await _error(response, str(exc), "failed", 500)
    except EngineFailed as exc:  # the engine stopped before a token went out: another worker may serve it
        outcome = "failed"
        return await _error(response, str(exc), "refused", 503)
    except Exception as exc:
        log.exception("request %s failed", body.request_id)
        return await _error(response, f"internal error: {exc}", "failed", 500)
    finally:
        # The handler may itself be cancelled here (the gateway closed the stream), so the cleanup
        # runs as its own task.  Aborting is idempotent: it frees the blocks if the request is
        # still anywhere in the engine, after an abandoned KV transfer settled.
        context.engine.close_stream(body.request_id)
        opened.close()
        context.movable_streams.discard(body.request_id)
        context.metrics.requests.labels("generate", outcome).inc()
        if outcome == "busy":
            # Nothing was allocated; forget the request now, so the gateway may send it here again
            # at once without finding it "already in flight".
            context.in_flight.untrack(body.request_id)
        else:
            context.in_flight.finish(body.request_id, lambda e: e.abort(body.request_id), wait_for=pending.release)
    return response


async def _error(response: web.StreamResponse, error: str, kind: str, status: int,
                 param: str | None = None) -> web.StreamResponse:
    """End the request with an error frame (``param``: the request field it is about): as the
    answer's status if the stream has not started."""
    if not response.prepared:
        return error_answer(error, kind, status, param)
    await _try_write(response, frame(TokenFrame(error=error, error_kind=kind, error_param=param)))
    return response


def error_answer(error: str, kind: str, status: int, param: str | None = None) -> web.Response:
    """The whole answer of a request that ends before its stream starts: one error frame."""
    return web.Response(body=frame(TokenFrame(error=error, error_kind=kind, error_param=param)), status=status,
                        content_type=FRAMES_CONTENT_TYPE)


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
        pass


async def add_local(context: RoleContext, body: GenerateRequest, grammar: CompiledGrammar | None) -> None:
    await context.engine.call(
        lambda e: e.add_request(body.prompt_token_ids, body.sampling_params, body.request_id, body.cache_salt, grammar,
                                body.resume_token_ids))


async def stream_outputs(context: RoleContext, stream: asyncio.Queue, response, started: float, opened: OpenStream,
                         fallback: bool) -> str:
    """Forward the engine's outputs for this request until it finishes; returns the finish reason.

    Every output queued by the time this handler runs goes out in one write (a handler that fell
    a step behind catches up in one write, not one per step)."""
    last = time.monotonic()
    while True:
        items = [await stream.get()]
        while not stream.empty() and not isinstance(items[-1], BaseException):
            items.append(stream.get_nowait())
        now = time.monotonic()
        frames = []
        for item in items:
            if isinstance(item, BaseException):
                if frames:
                    await response.write(b"".join(frames))
                if opened.started and isinstance(item, EngineFailed):
                    raise RuntimeError(str(item))  # mid-stream: the request cannot move any more
                raise item
            if item is MOVE_SOON:  # a drain hands it over soon: the gateway may pre-copy its KV
                frames.append(frame(TokenFrame(move_soon=True)))
                continue
            if item.error is not None:  # its grammar failed: what came before it goes out, then the error
                if frames:
                    await response.write(b"".join(frames))
                raise GrammarFailed(item.error)
            out = output_frame(item)
            if not opened.started:
                context.ttft.add(now - started)
                opened.first_token()
                out.prefill_fallback = fallback
            else:
                context.tpot.add(now - last)
            last = now
            frames.append(frame(out))
            if item.finished:
                await response.write(b"".join(frames))
                return item.finish_reason or "stop"
        await response.write(b"".join(frames))


@dataclass
class Reservation:
    """Blocks reserved on this worker for a prompt that ``peer`` computes."""

    peer: WorkerInfo
    block_ids: list[int]
    num_cached: int  # leading prompt tokens this worker already holds
    began: float
    # The engine's request, read-only outside the engine thread: whether the first token ends it.
    request: Request


async def reserve(context: RoleContext, body: GenerateRequest, grammar: CompiledGrammar | None
                  ) -> Reservation | None:
    """Reserve blocks for a remote prefill, leased for ``context.reservation_lease_s``; ``None``
    if they do not fit now.  Raises ``RemotePrefillFailed`` if the prefill worker is unknown,
    ``ValueError`` for bad input."""
    began = time.monotonic()
    try:
        peer = await resolve_prefill_worker(context, body.prefill_worker_id, moved_stream=bool(body.resume_token_ids))
    except BadPrefillAnswer as exc:
        raise RemotePrefillFailed(str(exc)) from None
    lease_s = context.reservation_lease_s

    def reserve_blocks(engine: Engine):
        request = engine.make_request(body.prompt_token_ids, body.sampling_params, body.request_id, body.cache_salt,
                                      grammar, body.resume_token_ids)
        reserved = engine.scheduler.reserve_remote(request, lease_s=lease_s)
        return None if reserved is None else (request, *reserved)

    reserved = await context.engine.call(reserve_blocks)
    if reserved is None:
        return None
    request, block_ids, num_cached = reserved
    return Reservation(peer, block_ids, num_cached, began=began, request=request)


async def remote_prefill(context: RoleContext, body: GenerateRequest, reservation: Reservation,
                         pending: PendingRelease) -> TokenFrame:
    """Have the prefill worker fill the reserved blocks.

    Returns the frame carrying the first token once the KV is all in; the request is not in the
    engine's batch yet (``land`` puts it there).  The frame says finished if that token ends the
    request.  Raises ``RemotePrefillFailed`` (every block freed -- or pinned while a frozen sender's
    payload may still land in it: ``release_reservation`` -- and the prefill worker told)
    if anything on the way fails.  Cancelled mid-transfer, or finding that the lease ended before
    the KV landed (``CancelledError`` then too), it leaves ``pending.release`` to free the blocks
    once the transfer has settled.
    """
    request_id = body.request_id
    began, peer, num_cached = reservation.began, reservation.peer, reservation.num_cached
    skip = num_cached // context.model.block_size
    dst_block_ids = reservation.block_ids[skip:]
    handle = context.kv_receiver.expect(request_id, dst_block_ids)
    moved = bool(body.resume_token_ids)  # the peer may be the worker the stream left, still ending it there
    peer_request_id = f"{request_id[:100]}#moved{len(body.resume_token_ids)}" if moved else request_id
    moved_stream_id = (body.precopy_of or request_id) if moved else None
    prefill = PrefillRequest(request_id=peer_request_id, prompt_token_ids=body.prompt_token_ids,
                             sampling_params=body.sampling_params, decode_worker_id=context.worker_id,
                             dst_block_ids=dst_block_ids, num_skip_blocks=skip,
                             transfer_id=handle.transfer_id, cache_salt=body.cache_salt,
                             resume_token_ids=body.resume_token_ids, moved_stream_id=moved_stream_id)
    call = asyncio.ensure_future(call_prefill_while_listed(context, peer, prefill))
    landed = asyncio.ensure_future(kv_landed(context, handle, reservation.request))
    try:
        result, landed_kv = await asyncio.gather(call, landed)
    except BaseException as exc:
        call.cancel()  # whichever failed first, the other one is of no use any more
        landed.cancel()
        # The blocks go back to the pool only once no more bytes can land in them; until then
        # the reservation keeps them.  A task of its own, so a handler cancelled again meanwhile
        # (the gateway's abort) cannot free them early.
        pending.release = context.spawn(release_reservation(context, request_id, handle))
        context.spawn(send_abort(context, peer, peer_request_id))
        context.peers.forget(peer.worker_id)  # it may have restarted elsewhere
        if isinstance(exc, asyncio.CancelledError):
            raise
        if isinstance(exc, LeaseEnded):  # its owner gives it up (the lease's end cancels this handler)
            raise asyncio.CancelledError() from None
        context.metrics.kv_transfer_failures.inc()
        await asyncio.shield(pending.release)  # the local fallback reuses the request id
        raise RemotePrefillFailed(f"{type(exc).__name__}: {exc}") from None
    transfer_seconds = time.monotonic() - began
    transfer_bytes = landed_kv.nbytes  # every rank's heads, as they arrived
    context.metrics.kv_transfer_seconds.observe(transfer_seconds)
    context.metrics.kv_received_bytes.inc(transfer_bytes)
    # The prefill worker sampled the first token under the same grammar; the matcher here continues
    # from it (``finish_remote``).  One the grammar forbids (a peer that did not apply it) is not
    # taken: the prompt is computed here instead.
    verdict = grammar_verdict(reservation.request, result.first_token_id)
    if verdict == "rejected":
        pending.release = context.spawn(release_reservation(context, request_id, handle))
        await asyncio.shield(pending.release)
        raise RemotePrefillFailed(f"the prefill worker's first token {result.first_token_id} breaks the grammar")
    ending = status_after_token(reservation.request, result.first_token_id, context.model.max_model_len)
    if ending is None and verdict == "stopped":
        ending = RequestStatus.FINISHED_STOPPED
    logprobs = None
    if result.first_logprob is not None:
        logprobs = [result.first_logprob]
    return TokenFrame(
        token_ids=[result.first_token_id], logprobs=logprobs, prompt_logprobs=result.prompt_logprobs,
        finished=ending is not None, finish_reason=None if ending is None else ending.finish_reason,
        num_prompt_tokens=len(body.prompt_token_ids),
        num_cached_tokens=max(num_cached, result.num_cached_tokens), prefill_worker=peer.worker_id,
        kv_transfer_bytes=transfer_bytes, kv_transfer_seconds=transfer_seconds,
    )


async def kv_landed(context: RoleContext, handle: IncomingTransfer, request: Request) -> TransferResult:
    """Wait for the KV to land, then stop the reservation's lease at once (not after the engine's
    step in flight), so a first token that is yet to come never finds it expired.  Raises
    ``LeaseEnded`` if the lease ended first, or what failed the transfer."""
    metadata = await handle.wait()
    if not context.engine.keep_lease(request):
        raise LeaseEnded(f"the lease on the blocks of {request.request_id!r} ended before its KV landed")
    return metadata


async def land(context: RoleContext, request_id: str, first_token_id: int) -> None:
    """Queue a request whose KV has landed to decode from ``first_token_id`` (between two engine
    steps: the engine thread's next call).  Raises ``CancelledError`` if it was aborted meanwhile
    (its lease stopped when its KV landed: ``kv_landed``)."""
    landed = await context.engine.call(
        lambda engine: engine.scheduler.finish_remote(request_id, first_token_id) is not None)
    if not landed:
        raise asyncio.CancelledError()


async def release_reservation(context: RoleContext, request_id: str, handle: IncomingTransfer) -> None:
    """Abort an abandoned transfer and free its reserved blocks once nothing more can land in them.

    A payload may be landing when the request is given up (prefill failed, client gone): freeing
    the blocks at once could let the rest of it overwrite whoever gets them next.  The receiver
    stops such a payload at once where the transport allows (TCP) and otherwise within its
    ``abort_grace`` (UCX; 5 s more where closing its connection does not end it at once:
    ``kvtransfer.transport_ucx``); ``settled()`` returns when it has.  A UCX payload whose sender froze in
    its middle cannot be stopped at all (``IncomingTransfer.still_landing``): the request ends
    all the same, and its blocks stay pinned until that payload ends (its sender resumes or dies).
    """
    handle.abort("decode side gave up")
    if not handle.done():
        context.metrics.kv_transfers_settling.inc()
        try:
            await handle.settled()
        finally:
            context.metrics.kv_transfers_settling.dec()
    still_landing = handle.still_landing

    def give_up(engine: Engine) -> list:
        pinned = engine.scheduler.handoff.decode.pin_landing(request_id, handle.block_ids) if still_landing else []
        engine.abort(request_id)
        return pinned

    try:
        pinned = await context.engine.call(give_up)
    except EngineFailed:
        return  # nothing runs any more; the process exits
    if pinned:
        context.spawn(unpin_once_landed(context, still_landing, pinned))


async def unpin_once_landed(context: RoleContext, still_landing: asyncio.Future, blocks: list) -> None:
    """Keep ``blocks`` out of use until the payload that may still write into them has ended.  No
    bound: only the transport can end it (its sender resumes or dies), and until it does the
    blocks are not safe to give anyone (``pdserve_worker_kv_blocks_still_landing`` counts them)."""
    context.metrics.kv_blocks_still_landing.inc(len(blocks))
    try:
        await asyncio.wait((still_landing,))
        await context.engine.call(lambda engine: engine.scheduler.handoff.decode.unpin(blocks))
    except EngineFailed:
        pass
    finally:
        context.metrics.kv_blocks_still_landing.dec(len(blocks))
