"""Room to run alone: how many blocks a request could hold if every other running request were
preempted, for the scheduler's liveness rules (``common.engine.scheduler``'s docstring).

Preemption frees the blocks of running requests only.  The blocks referenced by anything else --
reservations, landed requests, held requests, pins: the *outside* owners -- stay taken, so a
request can count on the pool minus those, except the ones it holds itself or shares with them
through the prefix cache::

    room(request) = num_blocks - |outside blocks - blocks of the request (or its prefix hits)|

It makes progress (samples a token) once all its tokens have KV: ``cdiv(num_tokens, block_size)``
blocks, which must fit in that room.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from common.engine.block_pool import KVCacheBlock
from common.engine.kv_cache_manager import KVCacheManager, cdiv
from common.engine.request import Request


class RoomAlone:
    """Answers "could it run alone?" for one block pool; ``owners`` are the request ids whose
    blocks preemption cannot free (the pins are always counted)."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv

    def outside(self, owners: Iterable[str]) -> set[int]:
        """Ids of the blocks held by ``owners`` or pinned."""
        tables = self.kv.req_to_blocks
        ids = set(self.kv.pins)
        for request_id in owners:
            ids.update(block.block_id for block in tables.get(request_id, ()))
        return ids

    def bound(self, owners: Iterable[str]) -> int:
        """At least ``len(self.outside(owners))``, without building it (a shared block counts twice)."""
        return sum(self.kv.num_blocks_of(request_id) for request_id in owners) + len(self.kv.pins)

    def own(self, request: Request, shared: Sequence[KVCacheBlock] = ()) -> set[int]:
        """The blocks ``request`` holds, or (waiting: it holds none) the prefix hits it would adopt."""
        blocks = self.kv.req_to_blocks.get(request.request_id) or shared
        return {block.block_id for block in blocks}

    def fits(self, request: Request, owners: Sequence[str], shared: Sequence[KVCacheBlock] = (),
             outside: set[int] | None = None) -> bool:
        """Whether ``request`` could hold the blocks of all its tokens with every other running
        request preempted.  ``outside`` (default: computed from ``owners``) may be passed to ask
        about fewer owners."""
        need = cdiv(request.num_tokens, self.kv.block_size)
        if outside is None:
            if need <= self.kv.pool.num_blocks - self.bound(owners):
                return True  # the fast answer: even if nothing were shared
            outside = self.outside(owners)
        return need <= self.kv.pool.num_blocks - len(outside - self.own(request, shared))

    def fits_after(self, request: Request, owners: Sequence[str], num_blocks: int,
                   hits: Sequence[KVCacheBlock]) -> bool:
        """Whether ``request`` would still fit once a new outside owner takes ``num_blocks`` blocks,
        ``hits`` of them prefix hits it shares: each new block, and each hit neither outside yet
        nor the request's own, is one block less for it."""
        need = cdiv(request.num_tokens, self.kv.block_size)
        if need <= self.kv.pool.num_blocks - self.bound(owners) - num_blocks:
            return True  # the fast answer: even if nothing were shared
        outside, own = self.outside(owners), self.own(request, self._hits(request))
        taken = num_blocks - len(hits) + sum(
            1 for block in hits if block.block_id not in outside and block.block_id not in own)
        return need <= self.kv.pool.num_blocks - len(outside - own) - taken

    def _hits(self, request: Request) -> list[KVCacheBlock]:
        """The prefix hits of a request that holds no blocks (none for one that does)."""
        return [] if self.kv.holds(request.request_id) else self.kv.find_cached_prefix(request)
