"""Whose turn it is: which reservations for remote KV the scheduler may grant without going before
a request that came first (``common.engine.scheduler``'s docstring has the rules).

Reservations are granted between steps, and what they reserve lands and is admitted before any
waiting request; so a request keeps its turn only if a reservation that would go before it is
refused:

  * the remote claimant, the oldest reservation refused for lack of room (``RemoteClaim``): a
    later reservation may not take the blocks it waits for;
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

Functions of a ``Scheduler``, which calls them from ``reserve_remote``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from common.engine.kv.block_pool import KVCacheBlock
from common.engine.kv.kv_cache_manager import cdiv
from common.engine.request import Request, RequestStatus
from common.engine.room_alone import final_tokens

if TYPE_CHECKING:
    from common.engine.scheduler import Scheduler


@dataclass
class RemoteClaim:
    """The oldest reservation refused for lack of room.  It holds no blocks: until ``expires``
    (each refusal of the same request id renews it), a reservation that would leave it less than
    ``num_blocks`` -- within the reservation budget, and free above the watermark -- is refused."""

    request_id: str
    num_blocks: int
    expires: float


def leaves_remote_claimant_room(s: Scheduler, request_id: str, num_blocks: int, now: float) -> bool:
    """Whether reserving ``num_blocks`` for ``request_id`` still leaves the remote claimant (if it is
    another request) its blocks, within the budget and the pool's free blocks above the watermark
    (a claimant bigger than the budget needs every other reservation gone: it is allowed only
    alone).  A claim that has expired (its request never came back) is dropped first."""
    claim = s.remote_claim
    if claim is not None and claim.expires <= now:
        s.remote_claim = claim = None
    if claim is None or claim.request_id == request_id:
        return True
    reserved = s.num_reserved_blocks + num_blocks
    free = s.kv.pool.num_free_blocks - num_blocks - s._watermark_blocks
    return reserved + claim.num_blocks <= s._remote_budget_blocks and free >= claim.num_blocks


def update_remote_claim(s: Scheduler, request_id: str, num_blocks: int, now: float, granted: bool) -> None:
    """After a reservation for ``request_id`` was decided: granted, it ends its own claim; refused,
    it claims its ``num_blocks`` if nobody else does (its own claim is renewed)."""
    claim = s.remote_claim
    if granted:
        if claim is not None and claim.request_id == request_id:
            s.remote_claim = None
    elif claim is None or claim.request_id == request_id:
        s.remote_claim = RemoteClaim(request_id, num_blocks, now + s.config.remote_claim_s)


def leaves_local_requests_their_turn(s: Scheduler, num_blocks: int, hits: Sequence[KVCacheBlock]) -> bool:
    """Whether a reservation of ``num_blocks`` (``hits``: the prefix hits among them) goes before no
    local request that came first: the head of ``waiting`` could still start, and the local
    claimant, if any, decodes and keeps the room to finish alone.  A head that is refused its turn
    takes the local claim if nobody holds it."""
    if s.waiting and not could_start(s, s.waiting[0], num_blocks, hits):
        if s.local_claim is None:
            s.local_claim = s.waiting[0]
        return False
    claimant = s.local_claim
    if claimant is None:
        return True
    if not (claimant.status == RequestStatus.RUNNING and claimant.num_tokens - claimant.num_computed_tokens == 1):
        return False  # its prompt is still being computed
    return s.room.fits_after(claimant, s.room.outside(s._outside_owners()), num_blocks, hits,
                             num_tokens=final_tokens(claimant, s.config.max_model_len))


def could_start(s: Scheduler, request: Request, num_blocks: int = 0, hits: Sequence[KVCacheBlock] = ()) -> bool:
    """Whether a step would admit the waiting ``request`` (at the head of the line, with a full
    budget) once a reservation of ``num_blocks`` (``hits`` among them) is granted: it has not waited
    through a step already, a seat in the batch is free, it could run alone, and the free blocks
    hold its first chunk (and the watermark while others run)."""
    if request is s._waited_a_step or len(s.running) >= s.config.max_num_seqs:
        return False
    own_hits = s.kv.find_cached_prefix(request)
    if not s.room.fits_after(request, s.room.outside(s._outside_owners()), num_blocks, hits, shared=own_hits):
        return False
    reserve = s._watermark_blocks if s.running else 0
    taken = num_blocks - len(hits) + sum(1 for block in hits if block.ref_cnt == 0)  # as allocate_slots counts
    return chunk_blocks(s, request, own_hits) + reserve <= s.kv.pool.num_free_blocks - taken


def chunk_blocks(s: Scheduler, request: Request, hits: Sequence[KVCacheBlock]) -> int:
    """The free blocks admitting the waiting ``request`` (``hits``: its prefix hits) with a full
    budget would take: its first chunk's new blocks, and its hits that sit in the free queue."""
    hit_tokens = len(hits) * s.block_size
    num_new = min(request.num_tokens - hit_tokens, s.config.max_num_batched_tokens)
    revived = sum(1 for block in hits if block.ref_cnt == 0)
    return cdiv(hit_tokens + num_new, s.block_size) - len(hits) + revived
