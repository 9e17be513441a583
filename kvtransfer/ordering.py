"""Ordering between the engine's writes into KV blocks and a transport reading them.

On CUDA a forward pass only *enqueues* its KV writes on the device stream, and the engine thread
moves on (a prefill chunk that samples nothing returns without a sync). A transport that reads
the blocks outside that stream -- UCX's progress thread, the TCP staging copy -- must first wait
until those writes are done. So the engine thread records a fence right after each forward, and
the sender waits on the fence of the step that completed a batch of blocks before it sends them::

    engine thread   step k: forward enqueued -> fence_k = record_fence() -> pin blocks, post (blocks, fence_k)
    device stream   [....... step k's KV writes .......]  fence_k done
    event loop      await wait_for_fence(fence_k)  -- a worker thread blocks on it, the loop goes on
                    -> channel.send(header, blocks)   (UCX may now read device memory)

A fence covers everything queued before it on its stream, so blocks written in earlier steps
(prefix-cache hits) are covered too. On CPU the writes are done when the forward returns:
``record_fence`` returns None and ``wait_for_fence(None)`` returns at once.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

import torch


class Fence(Protocol):
    """What a sender waits on: ``torch.cuda.Event`` (or a stand-in in unit tests)."""

    def query(self) -> bool:
        """True once everything before the fence has completed (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until then."""


def record_fence(device: torch.device) -> Fence | None:
    """A fence after the work queued so far on ``device``'s current stream; None on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


async def wait_for_fence(fence: Fence | None) -> None:
    """Return once ``fence`` has completed, without blocking the event loop (a worker thread
    waits; cancelling the caller leaves that thread to finish its bounded wait)."""
    if fence is None or fence.query():
        return
    await asyncio.to_thread(fence.synchronize)
