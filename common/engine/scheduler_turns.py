"""Whose turn it is: which reservations for remote KV the scheduler may grant without going before
a request that came first (``common.engine.scheduler``'s docstring has the rules).

Reservations are granted between steps, and what they reserve lands and is admitted before any
waiting request; so a request keeps its turn only if a reservation that would go before it is
refused:

  * the remote claimant, the oldest reservation refused for lack of room (``remote_kv.RemoteClaim``,
    kept by the hand-off's decode side): a later reservation may not take the blocks it waits for;
  * the head of ``waiting``: no reservation is granted while it cannot start -- it already waited
    through a step, or it could not run alone, has no seat in the batch, or finds too few free
    blocks for its first chunk (and the watermark while others run) -- or could not once the
    reservation is granted;
  * the local claimant, the oldest request refused its turn so (``Scheduler.local_claim``), until
    it finishes: while it has prompt tokens left to compute, no reservation is granted; once it
    decodes, only one that leaves it the room to run alone to its final length (prompt +
    ``max_tokens``), so it is never preempted, and recomputed, for a reservation.

The head and the claimant are judged when a reservation asks, and the claim is also taken after
each step; not in steps only, which the engine thread does not take while ``has_work`` is false.

``TurnTaking`` is the part of the ``Scheduler`` that judges this (from ``reserve_remote``).
"""
from __future__ import annotations

from typing import Sequence

from common.engine.kv.block_pool import KVCacheBlock
from common.engine.kv.kv_cache_manager import cdiv
from common.engine.request import Request, RequestStatus
from common.engine.room_alone import final_tokens


class TurnTaking:
    """The local side of the turns, as methods of the ``Scheduler`` (its queues, claims and room)."""

    def leaves_local_requests_their_turn(self, num_blocks: int, hits: Sequence[KVCacheBlock]) -> bool:
        """Whether a reservation of ``num_blocks`` (``hits``: the prefix hits among them) goes before
        no local request that came first: the head of ``waiting`` could still start, and the local
        claimant, if any, decodes and keeps the room to finish alone.  A head that is refused its
        turn takes the local claim if nobody holds it."""
        if self.waiting and not self.could_start(self.waiting[0], num_blocks, hits):
            if self.local_claim is None:
                self.local_claim = self.waiting[0]
            return False
        claimant = self.local_claim
        if claimant is None:
            return True
        if not (claimant.status == RequestStatus.RUNNING and claimant.num_tokens - claimant.num_computed_tokens == 1):
            return False  # its prompt is still being computed
        return self.room.fits_after(claimant, self.room.outside(self._outside_owners()), num_blocks, hits,
                                    num_tokens=final_tokens(claimant, self.config.max_model_len))

    def could_start(self, request: Request, num_blocks: int = 0, hits: Sequence[KVCacheBlock] = ()) -> bool:
        """Whether a step would admit the waiting ``request`` (at the head of the line, with a full
        budget) once a reservation of ``num_blocks`` (``hits`` among them) is granted: it has not
        waited through a step already, a seat in the batch is free, it could run alone, and the free
        blocks hold its first chunk (and the watermark while others run)."""
        if request is self._waited_a_step or len(self.running) >= self.config.max_num_seqs:
            return False
        own_hits = self.kv_manager.find_cached_prefix(request)
        if not self.room.fits_after(request, self.room.outside(self._outside_owners()), num_blocks, hits,
                                    shared=own_hits):
            return False
        reserve = self._watermark_blocks if self.running else 0
        taken = num_blocks - len(hits) + sum(1 for block in hits if block.ref_cnt == 0)  # as allocate_slots counts
        return self.chunk_blocks(request, own_hits) + reserve <= self.kv_manager.pool.num_free_blocks - taken

    def chunk_blocks(self, request: Request, hits: Sequence[KVCacheBlock]) -> int:
        """The free blocks admitting the waiting ``request`` (``hits``: its prefix hits) with a full
        budget would take: its first chunk's new blocks, and its hits that sit in the free queue."""
        hit_tokens = len(hits) * self.block_size
        num_new = min(request.num_tokens - hit_tokens, self.config.max_num_batched_tokens)
        revived = sum(1 for block in hits if block.ref_cnt == 0)
        return cdiv(hit_tokens + num_new, self.block_size) - len(hits) + revived
