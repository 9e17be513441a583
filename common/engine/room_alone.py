"""Room to run alone: how many blocks a request could hold if every other running request were
preempted, for the scheduler's liveness rules (``common.engine.scheduler``'s docstring).

Preemption frees the blocks of running requests only.  The blocks referenced by anything else --
reservations, landed requests, held requests, pins: the *outside* owners -- stay taken, so a
request can count on the pool minus those, except the ones it holds itself or shares with them
through the prefix cache::

    room(request) = num_blocks - |outside blocks - blocks of the request (or its prefix hits)|

It makes progress (samples a token) once all its tokens have KV: ``cdiv(num_tokens, block_size)``
blocks, which must fit in that room; it can finish once ``cdiv(final_tokens(request), block_size)``
do.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from common.engine.kv.block_pool import KVCacheBlock
from common.engine.kv.kv_cache_manager import KVCacheManager, cdiv
from common.engine.request import Request


def final_tokens(request: Request, max_model_len: int) -> int:
    """The most tokens ``request`` can reach: its prompt plus ``max_tokens``, within the context
    length (what ``Scheduler`` checks against the pool when a request comes in)."""
    return min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_model_len)


class Outside:
    """The blocks of one set of outside owners (and the pins), for many questions in a row while
    they do not change (one step's admissions): the cheap bound at once, the exact set on demand."""

    def __init__(self, kv: KVCacheManager, owners: Iterable[str]):
        self.kv_manager = kv
        self.owners = list(owners)
        # At least len(self.ids), without building it (a shared block counts twice).
        self.bound = sum(kv.num_blocks_of(request_id) for request_id in self.owners) + len(kv.pins)
        self._ids: set[int] | None = None

    @property
    def ids(self) -> set[int]:
        """Ids of the blocks held by the owners or pinned."""
        if self._ids is None:
            tables = self.kv_manager.req_to_blocks
            ids = set(self.kv_manager.pins)
            for request_id in self.owners:
                ids.update(block.block_id for block in tables.get(request_id, ()))
            self._ids = ids
        return self._ids


class RoomAlone:
    """Answers "could it run alone?" for one block pool, against an ``Outside``."""

    def __init__(self, kv: KVCacheManager):
        self.kv_manager = kv

    def outside(self, owners: Iterable[str]) -> Outside:
        return Outside(self.kv_manager, owners)

    def own(self, request: Request, shared: Sequence[KVCacheBlock] = ()) -> set[int]:
        """The blocks ``request`` holds, or (waiting: it holds none) the prefix hits it would adopt."""
        blocks = self.kv_manager.req_to_blocks.get(request.request_id) or shared
        return {block.block_id for block in blocks}

    def fits(self, request: Request, outside: Outside, shared: Sequence[KVCacheBlock] = (),
             num_tokens: int | None = None) -> bool:
        """Whether ``request`` could hold the blocks of ``num_tokens`` (default: all its tokens so
        far) with every other running request preempted."""
        need = cdiv(request.num_tokens if num_tokens is None else num_tokens, self.kv_manager.block_size)
        if need <= self.kv_manager.pool.num_blocks - outside.bound:
            return True  # the fast answer: even if nothing were shared
        return need <= self.kv_manager.pool.num_blocks - len(outside.ids - self.own(request, shared))

    def fits_after(self, request: Request, outside: Outside, num_blocks: int, hits: Sequence[KVCacheBlock],
                   num_tokens: int | None = None, shared: Sequence[KVCacheBlock] | None = None) -> bool:
        """Whether ``request`` would still fit (``num_tokens`` as for ``fits``) once a new outside
        owner takes ``num_blocks`` blocks, ``hits`` of them prefix hits it shares: each new block,
        and each hit neither outside yet nor the request's own, is one block less for it.
        ``shared``: the request's own prefix hits, if known (looked up when it holds no blocks)."""
        need = cdiv(request.num_tokens if num_tokens is None else num_tokens, self.kv_manager.block_size)
        if need <= self.kv_manager.pool.num_blocks - outside.bound - num_blocks:
            return True  # the fast answer: even if nothing were shared
        ids, own = outside.ids, self.own(request, self._hits(request) if shared is None else shared)
        taken = num_blocks - len(hits) + sum(1 for block in hits if block.block_id not in ids and block.block_id not in own)
        return need <= self.kv_manager.pool.num_blocks - len(ids - own) - taken

    def _hits(self, request: Request) -> list[KVCacheBlock]:
        """The prefix hits of a request that holds no blocks (none for one that does)."""
        return [] if self.kv_manager.holds(request.request_id) else self.kv_manager.find_cached_prefix(request)
