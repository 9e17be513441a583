"""The remote-KV hand-off: blocks whose KV one worker computes and another uses, as each side of it
sees them (vLLM v1 names its KV connector by role the same way).

Decode side (``DecodeSide``): blocks reserved for a prompt that a prefill worker computes, each
reservation under a lease; landed (its KV complete, the lease stops) or released (aborted, or the
lease ended).  The remote claim is the oldest reservation refused for lack of room: it holds no
blocks, but while it lasts a later reservation may not take the room it waits for.

Prefill side (``PrefillSide``): the blocks of a request that a step completed, ready to ship;
pins on blocks on the wire (a pinned block is neither freed nor evicted); requests that finished
but hold their blocks until they are shipped.

This module keeps the bookkeeping; the scheduler keeps the policy (whose turn it is, what fits the
pool: ``Scheduler.reserve_remote``) and asks it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection

from common.engine.config import SchedulerConfig
from common.engine.kv.block_pool import KVCacheBlock
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request, RequestStatus


@dataclass
class RemoteClaim:
    """The oldest reservation refused for lack of room.  It holds no blocks: until ``expires``
    (each refusal of the same request id renews it), a reservation that would leave it less than
    ``num_blocks`` -- within the reservation budget, and free above the watermark -- is refused."""

    request_id: str
    num_blocks: int
    expires: float


class DecodeSide:
    """Reservations for remote KV, their leases and the remote claim.  ``budget_blocks``: what
    reservations may hold together (one is always allowed, however large)."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, watermark_blocks: int):
        self.kv_manager = kv
        self.config = config
        self.watermark_blocks = watermark_blocks
        self.budget_blocks = int(config.remote_kv_budget * kv.pool.num_blocks)
        self.reservations: dict[str, Request] = {}  # blocks held for remote KV
        self.leases: dict[str, float] = {}  # reservation -> when its lease ends (unexpired ones; inf: stopped)
        self.claim: RemoteClaim | None = None

    @property
    def num_reserved_blocks(self) -> int:
        return sum(self.kv_manager.num_blocks_of(request_id) for request_id in self.reservations)

    def within_budget(self, num_blocks: int) -> bool:
        return not self.reservations or self.num_reserved_blocks + num_blocks <= self.budget_blocks

    def leaves_claimant_room(self, request_id: str, num_blocks: int, now: float) -> bool:
        """Whether reserving ``num_blocks`` for ``request_id`` still leaves the claimant (if it is
        another request) its blocks, within the budget and the pool's free blocks above the
        watermark (a claimant bigger than the budget needs every other reservation gone: it is
        allowed only alone).  A claim that has expired (its request never came back) is dropped."""
        claim = self.claim
        if claim is not None and claim.expires <= now:
            self.claim = claim = None
        if claim is None or claim.request_id == request_id:
            return True
        reserved = self.num_reserved_blocks + num_blocks
        free = self.kv_manager.pool.num_free_blocks - num_blocks - self.watermark_blocks
        return reserved + claim.num_blocks <= self.budget_blocks and free >= claim.num_blocks

    def decided(self, request_id: str, num_blocks: int, now: float, granted: bool) -> None:
        """After a reservation for ``request_id`` was decided: granted, it ends its own claim;
        refused, it claims its ``num_blocks`` if nobody else does (its own claim is renewed)."""
        claim = self.claim
        if granted:
            if claim is not None and claim.request_id == request_id:
                self.claim = None
        elif claim is None or claim.request_id == request_id:
            self.claim = RemoteClaim(request_id, num_blocks, now + self.config.remote_claim_s)

    def reserve(self, request: Request, num_cached_tokens: int, lease_ends: float) -> None:
        """``request`` holds its blocks (allocated by the scheduler) until its KV lands."""
        request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.leases[request.request_id] = lease_ends
        self.reservations[request.request_id] = request

    def expired_leases(self, now: float) -> list[str]:
        """Reservations whose lease ended: each is reported once, and its KV is refused from now on
        (``land`` returns ``None``)."""
        expired = [request_id for request_id, deadline in self.leases.items() if deadline <= now]
        for request_id in expired:
            del self.leases[request_id]
        return expired

    def next_lease_deadline(self) -> float | None:
        """When the earliest running lease ends (``None``: no lease running)."""
        deadline = min(self.leases.values(), default=math.inf)
        return None if deadline == math.inf else deadline

    def end_lease(self, request_id: str) -> bool:
        """The reservation's KV has all landed, so its lease stops: it never expires, and ``land``
        (or a release) ends it.  ``False`` if the lease had ended already."""
        if request_id not in self.leases:
            return False
        self.leases[request_id] = math.inf
        return True

    def land(self, request_id: str) -> Request | None:
        """The reservation's KV is complete: it is a reservation no more.  ``None`` if there is none
        under a lease (released, or its lease ended: its owner frees it)."""
        if request_id not in self.leases:
            return None
        del self.leases[request_id]
        return self.reservations.pop(request_id)

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s reservation and lease, if any (the scheduler frees its blocks)."""
        self.reservations.pop(request_id, None)
        self.leases.pop(request_id, None)

    def pin_landing(self, request_id: str, block_ids: Collection[int]) -> list[KVCacheBlock]:
        """Pin those of ``block_ids`` in ``request_id``'s table past its release: a payload that its
        transport cannot stop may still write into them (``IncomingTransfer.still_landing``);
        ``unpin`` them once it has ended."""
        wanted = set(block_ids)
        blocks = [block for block in self.kv_manager.req_to_blocks.get(request_id, ()) if block.block_id in wanted]
        self.kv_manager.pin(blocks)
        return blocks

    def unpin(self, blocks: list[KVCacheBlock]) -> None:
        self.kv_manager.unpin(blocks)


class PrefillSide:
    """What a prefill worker ships: a request's computed blocks, pinned while on the wire, and
    finished requests that keep their blocks until shipped (``held``)."""

    def __init__(self, kv: KVCacheManager):
        self.kv_manager = kv
        self.held: set[str] = set()

    def ready_blocks(self, request_id: str, start: int, stop: int) -> list[KVCacheBlock]:
        """Blocks ``start:stop`` of ``request_id``'s table (the caller knows their KV is written)."""
        return self.kv_manager.req_to_blocks[request_id][start:stop]

    def pin(self, blocks: list[KVCacheBlock]) -> None:
        """Keep ``blocks`` (neither freed nor evicted) while their bytes are on the wire."""
        self.kv_manager.pin(blocks)

    def unpin(self, blocks: list[KVCacheBlock]) -> None:
        self.kv_manager.unpin(blocks)

    def hold(self, request_id: str) -> None:
        """A finished request keeps its blocks until ``release``."""
        self.held.add(request_id)

    def release(self, request_id: str) -> None:
        """The finished request's KV has been shipped; its blocks become cache."""
        self.held.discard(request_id)
        self.kv_manager.free(request_id)


class RemoteKVHandoff:
    """Both sides of the hand-off over one KV cache manager (every worker can take either role)."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, watermark_blocks: int):
        self.decode = DecodeSide(kv, config, watermark_blocks)
        self.prefill = PrefillSide(kv)
