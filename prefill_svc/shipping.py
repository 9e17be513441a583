"""Shipping a request's KV blocks to its decode worker as soon as each chunk is computed.

The engine thread owns the blocks, so the decision "these blocks are complete, send them" is made
there, right after the step that completed them (``Shipper.after_step``).  Each such batch is
pinned (one extra reference) before the step ends, so neither a preemption nor the request's end
can hand the blocks to someone else while their bytes are on the wire; the sender unpins them
once sent. On CUDA the step's KV writes may still be running when the step returns: each batch
carries the fence recorded right after that step's forward (``kvtransfer.ordering``), and the
sender reads none of its blocks before the fence has completed.

    step k computes tokens 0..255   -> blocks 0..15 complete -> pin, queue (src 0..15 -> dst ...)
    step k+1 computes 256..511      -> blocks 16..31         -> pin, queue
    step k+2 finishes the prompt    -> blocks 32..33 (last one partial) + first token -> final
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.engine.kv.block_pool import KVCacheBlock
from common.engine.engine import Engine
from common.engine.kv.kv_cache_manager import cdiv
from common.cluster.registry import KVAddress
from common.engine.request import Request
from worker.engine_thread import EngineFailed
from kvtransfer.ordering import record_fence
from worker.role_context import RoleContext

FINAL = object()  # every block went out: the transfer finishes
# The request ended before its KV was all computed, with an error (its output posted in the same step)
# or aborted: the transfer fails.
ENDED = {"error": object(), "abort": object()}


class RequestEnded(Exception):
    """The request ended before its KV was all computed: nothing more ships.  ``with_output``: it
    ended with an error, whose output is on its way to the request's stream."""

    def __init__(self, message: str, with_output: bool):
        super().__init__(message)
        self.with_output = with_output


@dataclass
class ShippingJob:
    """One request whose KV goes to ``kv_address`` as transfer ``transfer_id``: block index ``i``
    lands in ``dst_block_ids[i - num_skip_blocks]`` (the decode worker already has the first ones)."""

    request_id: str
    transfer_id: str
    kv_address: KVAddress
    dst_block_ids: list[int]
    num_skip_blocks: int
    loop: asyncio.AbstractEventLoop
    request: Request | None = None
    num_kv_tokens: int = 0  # tokens whose KV is shipped: the prompt (and a moved stream's outputs)
    next_index: int = 0  # engine thread: first block index not yet queued
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def post(self, item) -> None:
        """Engine thread -> event loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Shipper:
    """Engine-thread side of KV shipping for every request this worker prefills."""

    def __init__(self, context: RoleContext):
        self.context = context
        self.jobs: dict[str, ShippingJob] = {}  # touched only in the engine thread
        self._fence = None  # recorded after the latest forward (None on CPU)

    def on_kv_written(self, _out) -> None:
        """Engine thread, right after a forward is enqueued (``ModelRunner.on_kv_written``)."""
        self._fence = record_fence(self.context.model.device) if self.jobs else None

    def start(self, engine: Engine, job: ShippingJob, request: Request) -> None:
        """Engine thread: admit the request and start watching its blocks: those of every token it
        holds before it samples (a moved stream's outputs too, ``resume_request``)."""
        job.num_kv_tokens = request.num_tokens
        num_blocks = cdiv(job.num_kv_tokens, engine.config.block_size)
        if len(job.dst_block_ids) != num_blocks - job.num_skip_blocks:
            raise ValueError(
                f"{len(job.dst_block_ids)} destination blocks for a prompt of {num_blocks} blocks "
                f"with {job.num_skip_blocks} skipped")
        request.hold_blocks_on_finish = True
        engine.scheduler.add_request(request)
        job.request = request
        job.next_index = job.num_skip_blocks
        self.jobs[request.request_id] = job

    def stop(self, engine: Engine, request_id: str) -> None:
        """Engine thread: forget the job and abort the request if it is still running."""
        self.jobs.pop(request_id, None)
        engine.abort(request_id)

    def after_step(self, engine: Engine, _outputs) -> None:
        bs = engine.config.block_size
        for request_id, job in list(self.jobs.items()):
            request = job.request
            if request.is_finished and request.status.finish_reason in ("abort", "error"):
                del self.jobs[request_id]
                if request.hold_blocks_on_finish:  # (an error's: an abort freed them)
                    engine.scheduler.release_held(request_id)  # nothing more ships (the pins keep what did)
                job.post(ENDED[request.status.finish_reason])
                continue
            if request.is_finished:
                limit = cdiv(job.num_kv_tokens, bs)
            else:
                limit = min(request.num_computed_tokens, job.num_kv_tokens) // bs
            if limit > job.next_index:
                outgoing = engine.scheduler.handoff.prefill
                blocks: list[KVCacheBlock] = outgoing.ready_blocks(request_id, job.next_index, limit)
                outgoing.pin(blocks)
                dst = job.dst_block_ids[job.next_index - job.num_skip_blocks : limit - job.num_skip_blocks]
                job.post(([b.block_id for b in blocks], dst, blocks, self._fence))
                job.next_index = limit
            if request.is_finished:
                engine.scheduler.release_held(request_id)  # the pins keep the shipped blocks alive
                del self.jobs[request_id]
                job.post(FINAL)


async def ship(context: RoleContext, job: ShippingJob) -> int:
    """Event loop: send each queued batch, unpin it, then finish the transfer.  The first token goes
    to the decode worker once, in the answer to its /prefill call, not with the KV.

    A batch is unpinned by a command the engine thread runs between steps; nothing waits for it,
    or the first token would wait for the step running meanwhile -- often another prompt's whole
    chunk.  The commands still run before the request's own cleanup (queued later, run in order).

    Returns the number of blocks sent.  Raises ``TransferError`` subclasses on failure.
    """
    sent = 0
    address = f"{job.kv_address.host}:{job.kv_address.port}"
    transfer = await context.kv_sender.begin(job.transfer_id, address)
    try:
        while True:
            item = await job.queue.get()
            if item is FINAL:
                await transfer.finish()
                return sent
            if item in ENDED.values():
                raise RequestEnded(f"request {job.request_id!r} ended before its KV was computed",
                                   with_output=item is ENDED["error"])
            src, dst, blocks, fence = item
            try:
                await transfer.send_blocks(src, dst, fence)
                sent += len(src)
            finally:
                context.spawn(unpin(context, blocks))
    except BaseException as exc:
        transfer.abort(f"prefill side failed: {type(exc).__name__}")
        raise


async def unpin(context: RoleContext, blocks: list[KVCacheBlock]) -> None:
    try:
        await asyncio.shield(context.engine.call(lambda e: e.scheduler.handoff.prefill.unpin(blocks)))
    except EngineFailed:
        pass  # the engine has stopped: no block is handed out any more


async def unpin_leftovers(context: RoleContext, job: ShippingJob) -> None:
    """After the job is stopped in the engine thread: release batches that were never sent."""
    while not job.queue.empty():
        item = job.queue.get_nowait()
        if isinstance(item, tuple):  # (not FINAL nor ENDED)
            await unpin(context, item[2])
