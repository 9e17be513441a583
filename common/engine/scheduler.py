"""One scheduler for every role: a token budget per step, no prefill or decode phases.

Each step, in order:
  1. running requests that decode take their one token each,
  2. running requests with a partial prompt continue their prefill,
  3. waiting requests are admitted first-come-first-served, the last one chunked to fit
     ``max_num_batched_tokens``; ``max_num_seqs`` caps the batch and a watermark of free blocks
     is kept for running decodes.
When blocks run out, the newest running request is preempted (its blocks freed) and recomputed
later.  The output is a plain ``SchedulerOutput``.

Blocks held outside ``running`` cannot be taken back by preemption, so they are bounded, or the
pool could fill with them while nothing runs (``running=0, waiting>0``, forever):

    reservations  (decode role: blocks waiting for remote KV)  at most ``remote_kv_budget`` of the
                  pool (one is always allowed), each with a lease; the owner frees an expired one
                  once no more bytes can land in it (``expired_leases``)
    claim         (decode role: the oldest refused reservation) holds no blocks: while it lasts, a
                  reservation that would take room the claimant needs is refused, so room builds
                  up for it (first come, first served; a long prompt is not starved by short ones
                  taking the room as it frees).  It ends when the claimant gets its reservation,
                  or ``remote_claim_s`` after its last try (its request never came back)
    landed        (remote KV complete, not yet running)        admitted before new prompts and
                  without the watermark; if even so nothing can run, the newest is preempted
    pins          (prefill role: blocks on the wire)           released as soon as sent
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.engine.config import SchedulerConfig
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions starting at
    ``num_computed_tokens``, writing KV into ``block_ids``; sample a token if ``sample``."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # before this step; makes seeded sampling stateless
    # The request's own lists (not copies), read by the sampler for penalties.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # The request's row in ``KVCacheManager.table``, the persistent form of ``block_ids``.
    table_row: int = -1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RemoteClaim:
    """The oldest reservation refused for lack of room: ``num_blocks`` are kept for it until
    ``expires`` (each refusal of the same request id renews it)."""

    request_id: str
    num_blocks: int
    expires: float


def status_after_token(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """What appending ``token_id`` as its next output token makes of ``request``: finished by a
    stop token or by length, or ``None`` if it goes on.  Reads the request only, so a decode worker
    can tell before a remote prompt lands whether its first token ends it."""
    if token_id in request.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if (request.num_output_tokens + 1 >= request.sampling_params.max_tokens
            or request.num_tokens + 1 >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


class Scheduler:
    """Owns the request queues and the KV cache manager; see the module docstring."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # hold no blocks
        self.landed: deque[Request] = deque()  # decode role: remote KV complete, blocks held
        self.running: list[Request] = []
        self.reservations: dict[str, Request] = {}  # decode role: blocks held for remote KV
        self._leases: dict[str, float] = {}  # reservation -> when its lease ends (unexpired ones)
        self.held: set[str] = set()  # prefill role: finished, blocks kept until shipped
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * kv_manager.pool.num_blocks)
        self._remote_budget_blocks = int(config.remote_kv_budget * kv_manager.pool.num_blocks)
        self.claim: RemoteClaim | None = None  # decode role: the oldest refused reservation

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._validate(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_remote(
        self, request: Request, lease_s: float | None = None, now: float | None = None
    ) -> tuple[list[int], int] | None:
        """Decode role: allocate blocks for a prompt whose KV another worker computes.

        Returns ``(block_ids, num_cached_tokens)``: the request's whole block table and how many
        leading prompt tokens this worker already holds (their KV need not be sent).  ``None`` if
        the blocks do not fit now, or reservations already hold their budget.  The reservation's
        lease ends ``lease_s`` (default: the config's ``remote_lease_s``) after ``now``.
        """
        self._validate(request)
        now = time.monotonic() if now is None else now
        if self.claim is not None and self.claim.expires <= now:
            self.claim = None  # its request never came back
        cached = self.kv.find_cached_prefix(request)
        num_cached_tokens = len(cached) * self.block_size
        needed = -(-request.num_tokens // self.block_size)
        claim = self.claim
        if claim is not None and claim.request_id != request.request_id and not self._leaves_room(claim, needed):
            return None  # first come, first served: the claimant waits for this room
        # The watermark keeps room for requests that will grow; with none, the pool is all there is.
        reserve = self._watermark_blocks if self.running or self.landed or self.reservations else 0
        new_blocks = None
        if not self.reservations or self.num_reserved_blocks + needed <= self._remote_budget_blocks:
            new_blocks = self.kv.allocate_slots(
                request, request.num_tokens - num_cached_tokens, cached, reserve_blocks=reserve)
        if new_blocks is None:
            if claim is None or claim.request_id == request.request_id:
                self.claim = RemoteClaim(request.request_id, needed, now + self.config.remote_claim_s)
            return None
        if claim is not None and claim.request_id == request.request_id:
            self.claim = None
        request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._leases[request.request_id] = now + (self.config.remote_lease_s if lease_s is None else lease_s)
        self.requests[request.request_id] = request
        self.reservations[request.request_id] = request
        return self.kv.block_ids(request.request_id), num_cached_tokens

    def _leaves_room(self, claim: RemoteClaim, num_blocks: int) -> bool:
        """Whether reserving ``num_blocks`` more still leaves the claimant its blocks, within the
        budget and the pool's free blocks above the watermark (a claimant bigger than the budget
        needs every other reservation gone: it is allowed only alone)."""
        reserved = self.num_reserved_blocks + num_blocks
        free = self.kv.pool.num_free_blocks - num_blocks - self._watermark_blocks
        return reserved + claim.num_blocks <= self._remote_budget_blocks and free >= claim.num_blocks

    @property
    def num_reserved_blocks(self) -> int:
        return sum(self.kv.num_blocks_of(rid) for rid in self.reservations)

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Reservations whose lease ended: each is reported once, and its KV is refused from now on
        (``finish_remote`` returns ``None``).  The caller frees each with ``abort`` once no more
        bytes can land in its blocks."""
        now = time.monotonic() if now is None else now
        expired = [rid for rid, deadline in self._leases.items() if deadline <= now]
        for rid in expired:
            del self._leases[rid]
        return expired

    def next_lease_deadline(self) -> float | None:
        """When the earliest unexpired lease ends (``None``: no lease running)."""
        return min(self._leases.values(), default=None)

    def finish_remote(self, request_id: str, first_token_id: int) -> Request | None:
        """Decode role: the prompt's KV has landed; queue the request to decode from ``first_token_id``.

        Returns the request (finished at once if that token already stops it), or ``None`` if it
        was aborted meanwhile.
        """
        request = self.requests.get(request_id)
        if request is None or request_id not in self._leases:
            return None  # aborted, or its lease ended: its owner frees it
        del self.reservations[request_id], self._leases[request_id]
        request.num_computed_tokens = request.num_tokens
        self.kv.commit(request)
        request.status = RequestStatus.WAITING
        self._append_token(request, first_token_id)
        if request.is_finished:
            self._finish(request)
        else:
            self.landed.append(request)  # it holds its blocks: it goes before new prompts
        return request

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is required")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens but the context length is "
                f"{self.config.max_model_len}; it must leave room for at least one output token"
            )
        # A request must fit the pool alone, so preempting everyone else always makes room for it.
        capacity = self.kv.pool.num_blocks * self.block_size
        longest = min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.max_model_len)
        if longest > capacity:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.sampling_params.max_tokens}) needs {longest} tokens of KV cache but it holds "
                f"only {capacity}"
            )

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running[-1]
                budget += self._preempt(victim, scheduled, out)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                scheduled[request.request_id] = self._schedule_one(request, num_new)
                budget -= num_new

        # New requests only when nothing had to be preempted: otherwise they would evict each other.
        if not out.preempted_request_ids:
            budget = self._admit(scheduled, budget)
            if not scheduled and self.landed:
                # Nothing runs and a landed request cannot get the block it needs next: the pool is
                # full of blocks nobody can preempt.  Recompute the newest landed request instead.
                victim = self.landed.pop()
                self._requeue(victim)
                out.preempted_request_ids.append(victim.request_id)
                budget = self._admit(scheduled, budget)

        out.scheduled = list(scheduled.values())
        out.num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _admit(self, scheduled: dict[str, ScheduledRequest], budget: int) -> int:
        """Admit landed requests (they hold their blocks: no watermark), then waiting ones in FCFS
        order.  The watermark keeps room for running decodes, so it applies only while some run."""
        for queue in (self.landed, self.waiting):
            while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = queue[0]
                cached = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
                num_hit_tokens = len(cached) * self.block_size
                num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
                reserve = self._watermark_blocks if self.running and queue is self.waiting else 0
                if self.kv.allocate_slots(request, num_new, cached, reserve_blocks=reserve) is None:
                    break  # first come, first served: nobody overtakes the head of the queue
                queue.popleft()
                request.num_computed_tokens += num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled[request.request_id] = self._schedule_one(request, num_new)
                budget -= num_new
        return budget

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            table_row=self.kv.table.row(request.request_id),
        )

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput) -> int:
        """Free the victim's blocks and send it back to the front of the queue.

        Returns the budget it had already been given this step (now handed back)."""
        self.running.remove(victim)
        self._requeue(victim)
        out.preempted_request_ids.append(victim.request_id)
        returned = scheduled.pop(victim.request_id, None)
        return len(returned.token_ids) if returned else 0

    def _requeue(self, victim: Request) -> None:
        """Take the victim's blocks back; it is recomputed from its first token when admitted again."""
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the requests of a finished step; returns those that produced a token or finished."""
        changed = []
        for item in out.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(item.token_ids)
            self.kv.commit(request)
            if not item.sample:
                continue
            self._append_token(request, sampled[item.request_id])
            if request.is_finished:
                self._finish(request)
            changed.append(request)
        return changed

    def _append_token(self, request: Request, token_id: int) -> None:
        status = status_after_token(request, token_id, self.config.max_model_len)
        request.append_output_token(token_id)
        if status is RequestStatus.FINISHED_STOPPED:
            request.stop_reason = token_id
        if status is not None:
            request.status = status

    # ---- leaving ---------------------------------------------------------------------------

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Finish a request now, wherever it is, and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for queue in (self.waiting, self.landed):
            if request in queue:
                queue.remove(request)
        request.status = status
        request.hold_blocks_on_finish = False
        self._finish(request)
        return request

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        del self.requests[request.request_id]
        self.reservations.pop(request.request_id, None)
        self._leases.pop(request.request_id, None)
        if request.hold_blocks_on_finish:
            self.held.add(request.request_id)
        else:
            self.kv.free(request.request_id)

    def release_held(self, request_id: str) -> None:
        """Prefill role: the KV of a finished request has been shipped; its blocks become cache."""
        self.held.discard(request_id)
        self.kv.free(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.landed)

    @property
    def num_waiting_for_remote(self) -> int:
        return len(self.reservations)

    def has_work(self) -> bool:
        """Anything a step could compute now (requests waiting for remote KV do not count)."""
        return bool(self.waiting or self.landed or self.running)

    def check_integrity(self) -> None:
        """Assert that the pool is sound, that every reference on a block has an owner (a block
        table or a pin), and that every request is in exactly one place, in a state that fits it."""
        self.kv.check_integrity()
        places = {
            "running": (self.running, {RequestStatus.RUNNING}),
            "waiting": (self.waiting, {RequestStatus.WAITING, RequestStatus.PREEMPTED}),
            "landed": (self.landed, {RequestStatus.WAITING}),
            "reservations": (list(self.reservations.values()), {RequestStatus.WAITING_FOR_REMOTE_KV}),
        }
        seen: dict[str, str] = {}
        for place, (requests, states) in places.items():
            for request in requests:
                rid = request.request_id
                assert rid not in seen, f"{rid!r} is in both {seen[rid]} and {place}"
                seen[rid] = place
                assert request.status in states, f"{rid!r} is in {place} as {request.status.name}"
                assert self.requests.get(rid) is request, f"{rid!r} is in {place} but not among the requests"
                if place == "waiting":
                    assert not self.kv.holds(rid), f"waiting request {rid!r} holds blocks"
                else:
                    capacity = self.kv.num_blocks_of(rid) * self.block_size
                    assert capacity >= request.num_computed_tokens, f"{rid!r} has KV beyond its blocks"
        assert set(self._leases) <= set(self.reservations), "a lease without a reservation"
        assert self.claim is None or self.claim.request_id not in self.reservations, "a granted claim is still held"
        assert set(seen) == set(self.requests), f"requests in no queue: {set(self.requests) - set(seen)}"
        assert not self.held & set(self.requests), "a held request is still unfinished"
        owners = set(self.requests) | self.held
        assert set(self.kv.req_to_blocks) <= owners, (
            f"block tables of unknown requests: {set(self.kv.req_to_blocks) - owners}")
