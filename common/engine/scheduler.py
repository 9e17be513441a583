"""One scheduler for every role: a token budget per step, no prefill or decode phases.

Each step, in order:
  1. running requests that decode take their one token each (and their speculative drafts, out of
     the tokens the others' next tokens and the head of the line's next chunk leave, and the
     blocks the others' next tokens leave),
  2. running requests with a partial prompt continue their prefill,
  3. landed requests, then waiting ones, are admitted first-come-first-served, the last one chunked
     to fit ``max_num_batched_tokens``; ``max_num_seqs`` caps the batch and a watermark of free
     blocks is kept for running decodes.
When blocks run out, the newest running request is preempted (its blocks freed) and recomputed
later.  The output is a plain ``SchedulerOutput``.

Blocks held outside ``running`` cannot be taken back by preemption, so they are bounded, or the
pool could fill with them while nothing runs (``running=0, waiting>0``, forever):

    reservations  (decode role: blocks waiting for remote KV)  at most ``remote_kv_budget`` of the
                  pool (one is always allowed), each with a lease; the owner frees an expired one
                  once no more bytes can land in it (``expired_leases``)
    remote claim  (decode role: the oldest refused reservation) holds no blocks: while it lasts, a
                  reservation that would take room the claimant needs is refused, so room builds
                  up for it (first come, first served; a long prompt is not starved by short ones
                  taking the room as it frees).  It ends when the claimant gets its reservation,
                  or ``remote_claim_s`` after its last try (its request never came back)
    landed        (remote KV complete, not yet running)        admitted before new prompts and
                  without the watermark
    held, pins    (prefill role: finished, or on the wire)     released as soon as sent

Their bookkeeping is the remote-KV hand-off's (``remote_kv``); the policy (what fits) is this module's.

Reservations and local requests take turns first come, first served (``scheduler_turns``): a
reservation is refused while the head of ``waiting`` could not start (or could not once it is
granted), and while the local claimant -- the oldest request found unable to start, until it
finishes -- computes its prompt or would lose the room to finish alone.  Both are judged when a
reservation asks, not only in steps (which the engine thread skips while ``has_work`` is false).

Room to run alone (``room_alone``): a request samples a token only once all its tokens have KV,
and the most it can ever hold is what preempting every other running request leaves.  One that
needs more cannot make progress until something outside ``running`` lets go, so
  * it is not admitted (it would compute a chunk, preempt itself, be admitted again from its
    cached blocks, forever: steps never empty, the queue behind it never served); requests behind
    it that fit go ahead, except those that will hold their blocks on finish (what it waits for);
  * running and out of blocks, it preempts itself only: the others' blocks would not be enough;
  * landed, it is recomputed (the newest landed request if that makes room for it, else itself);
  * waiting, it heads the line once the requests before it that fit are admitted, and no
    reservation then replaces what it waits for (above).
A step with nothing to do is then empty and ``has_work`` is false: the engine thread sleeps.
"""
from __future__ import annotations

import time
from collections import deque

from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager, cdiv
from common.engine.prompt_logprobs import scored_rows
from common.engine.request import Request, RequestStatus
from common.engine.remote_kv import RemoteClaim, RemoteKVHandoff
from common.engine.room_alone import RoomAlone, final_tokens
from common.engine.scheduler_integrity import check_scheduler
from common.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from common.engine.scheduler_turns import TurnTaking
from common.engine.speculative.speculation import Speculation, SpeculativeConfig


class Scheduler(TurnTaking):
    """Owns the request queues and the KV cache manager; see the module docstring.  What is held
    for the remote-KV hand-off (reservations, leases, the remote claim; held requests, pins) is
    ``handoff``'s bookkeeping, asked by the policy here."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, speculation: Speculation | None = None):
        self.config = config
        # Draft tokens for decoding requests (``common.engine.speculative``); off unless configured.
        self.speculation = speculation or Speculation(SpeculativeConfig(), config.max_model_len)
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # hold no blocks
        self.landed: deque[Request] = deque()  # decode role: remote KV complete, blocks held
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * kv_manager.pool.num_blocks)
        self.handoff = RemoteKVHandoff(kv_manager, config, self._watermark_blocks)
        self.local_claim: Request | None = None  # the oldest request refused its turn, until it ends
        self._waited_a_step: Request | None = None  # the head of ``waiting`` when the last step ended
        # Waiting requests that free their blocks on finish: behind a request passed over, only
        # these may start (``_admit_waiting``), so a scan ends when none is left.
        self._num_waiting_releasing = 0
        self.room = RoomAlone(kv_manager)

    @property
    def reservations(self) -> dict[str, Request]:
        """Decode role: requests holding blocks for remote KV (``handoff.decode``)."""
        return self.handoff.decode.reservations

    @property
    def held(self) -> set[str]:
        """Prefill role: finished requests whose blocks are kept until shipped (``handoff.prefill``)."""
        return self.handoff.prefill.held

    @property
    def remote_claim(self) -> RemoteClaim | None:
        """Decode role: the oldest reservation refused for lack of room (``handoff.decode``)."""
        return self.handoff.decode.claim

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._validate(request)
        self.requests[request.request_id] = request
        self._queue(request)

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
        decode = self.handoff.decode
        now = time.monotonic() if now is None else now
        needed = cdiv(request.num_tokens, self.block_size)
        if not decode.leaves_claimant_room(request.request_id, needed, now):
            return None  # first come, first served: the claimant waits for this room
        cached = self.kv_manager.find_cached_prefix(request)
        num_cached_tokens = len(cached) * self.block_size
        # The watermark keeps room for requests that will grow; with none, the pool is all there is.
        reserve = self._watermark_blocks if self.running or self.landed or self.reservations else 0
        new_blocks = None
        if self.leaves_local_requests_their_turn(needed, cached) and decode.within_budget(needed):
            # (the turn first: it may take the local claim)
            new_blocks = self.kv_manager.allocate_slots(
                request, request.num_tokens - num_cached_tokens, cached, reserve_blocks=reserve)
        decode.decided(request.request_id, needed, now, granted=new_blocks is not None)
        if new_blocks is None:
            return None
        decode.reserve(request, num_cached_tokens, now + (self.config.remote_lease_s if lease_s is None else lease_s))
        self.requests[request.request_id] = request
        return self.kv_manager.block_ids(request.request_id), num_cached_tokens

    @property
    def num_reserved_blocks(self) -> int:
        return self.handoff.decode.num_reserved_blocks

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Reservations whose lease ended: each is reported once, and its KV is refused from now on
        (``finish_remote`` returns ``None``).  The caller frees each with ``abort`` once no more
        bytes can land in its blocks."""
        return self.handoff.decode.expired_leases(time.monotonic() if now is None else now)

    def next_lease_deadline(self) -> float | None:
        """When the earliest running lease ends (``None``: no lease running)."""
        return self.handoff.decode.next_lease_deadline()

    def end_lease(self, request_id: str) -> bool:
        """Decode role: the reservation's KV has all landed, so its lease stops: it never expires,
        and ``finish_remote`` (or ``abort``) ends it.  ``False`` if the lease had ended already."""
        return self.handoff.decode.end_lease(request_id)

    def finish_remote(self, request_id: str, first_token_id: int) -> Request | None:
        """Decode role: the prompt's KV has landed; queue the request to decode from ``first_token_id``.

        Returns the request (finished at once if that token already stops it), or ``None`` if it
        was aborted meanwhile.
        """
        request = self.handoff.decode.land(request_id)
        if request is None:
            return None  # aborted, or its lease ended: its owner frees it
        request.num_computed_tokens = request.num_tokens
        request.prompt_scored_elsewhere()
        self.kv_manager.commit(request)
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
        capacity = self.kv_manager.pool.num_blocks * self.block_size
        longest = final_tokens(request, self.config.max_model_len)
        if longest > capacity:
            raise ValueError(f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens ({request.sampling_params.max_tokens})"
                             f" needs {longest} tokens of KV cache but it holds only {capacity}")

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        contended = False  # a request that could grow took blocks from others

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        self.speculation.begin_step(len(decoding))
        # Drafts take the tokens the step leaves once every running request has its next token and the
        # head of the line its next chunk, and the blocks the running requests leave (they preempted some).
        behind, head_due = len(decoding) + len(prefilling), self._head_due()
        blocks_behind = self.kv_manager.blocks_for_next_tokens(decoding + prefilling, budget) if self.speculation.proposer else 0
        for request in decoding + prefilling:
            behind -= 1
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            blocks_behind -= self.kv_manager.blocks_needed(request, num_new) if blocks_behind else 0
            if self.kv_manager.allocate_slots(request, num_new) is None:
                if not self._fits_alone(request):
                    self._preempt(request, scheduled, out)  # the others' blocks would not be enough
                    continue
                contended = True
                while self.kv_manager.allocate_slots(request, num_new) is None:
                    victim = self.running[-1]
                    budget += self._preempt(victim, scheduled, out)
                    if victim is request:
                        break
            if request.status == RequestStatus.RUNNING:
                spare = max(budget - num_new - behind - head_due, 0)
                drafts = self.speculation.draft(request, spare, self.kv_manager, blocks_behind) if num_new == 1 else []
                scheduled[request.request_id] = self._schedule_one(request, num_new, drafts)
                budget -= num_new + len(drafts)

        # New requests only when no request that could grow had to preempt: otherwise they would
        # evict each other.
        if not contended:
            budget = self._admit_landed(scheduled, budget, out)
            budget = self._admit_waiting(scheduled, budget)
        # Whoever still heads the line has waited through this step: it claims, if nobody does.
        self._waited_a_step = self.waiting[0] if self.waiting else None
        if self.local_claim is None:
            self.local_claim = self._waited_a_step

        out.scheduled = list(scheduled.values())
        self.speculation.complete_drafts(out.scheduled)
        out.num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _head_due(self) -> int:
        """The tokens the next request in line would take this step, where a seat is free for it."""
        line = self.landed or self.waiting
        if not line or len(self.running) >= self.config.max_num_seqs:
            return 0
        return min(line[0].num_tokens - line[0].num_computed_tokens, self.config.max_num_batched_tokens)

    def _admit_landed(self, scheduled: dict[str, ScheduledRequest], budget: int, out: SchedulerOutput) -> int:
        """Admit landed requests in order, without the watermark (they hold their blocks).  One
        that cannot run alone is recomputed: the newest landed request if that leaves it room
        (landed requests can fill the pool between them with nothing running), else itself."""
        while self.landed and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.landed[0]
            if not self._fits_alone(request):
                victim = self.landed[-1]
                if victim is not request and not self.room.fits(
                        request, self.room.outside(self._outside_owners(landed=False))):
                    victim = request
                self.landed.remove(victim)
                self._requeue(victim)
                out.preempted_request_ids.append(victim.request_id)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv_manager.allocate_slots(request, num_new) is None:
                break  # running requests hold the block it needs: they will let go
            self.landed.popleft()
            budget = self._start(request, num_new, scheduled, budget)
        return budget

    def _admit_waiting(self, scheduled: dict[str, ScheduledRequest], budget: int) -> int:
        """Admit waiting requests first come, first served, with the watermark while some run.  One
        that cannot run alone is passed over until it can; behind it, only requests that free their
        blocks on finish may start (one that would hold them would add to what it waits for)."""
        index = 0
        passed_over = False
        releasing_left = self._num_waiting_releasing  # among the requests not looked at yet
        outside = None  # the same for every request here: admissions change only ``running``
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if passed_over and not releasing_left:
                break  # every request left would hold its blocks on finish: none may start
            request = self.waiting[index]
            releasing_left -= not request.hold_blocks_on_finish
            if passed_over and request.hold_blocks_on_finish:
                index += 1
                continue
            cached = self.kv_manager.find_cached_prefix(request)
            outside = outside or self.room.outside(self._outside_owners())
            if not self.room.fits(request, outside, cached):
                passed_over = True
                index += 1
                continue
            num_hit_tokens = len(cached) * self.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            reserve = self._watermark_blocks if self.running else 0
            if self.kv_manager.allocate_slots(request, num_new, cached, reserve_blocks=reserve) is None:
                break  # first come, first served: nobody overtakes a request that can run
            self._unqueue(request, index)
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit_tokens
            budget = self._start(request, num_new, scheduled, budget)
        return budget

    def _queue(self, request: Request, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(request)
        self._num_waiting_releasing += not request.hold_blocks_on_finish

    def _unqueue(self, request: Request, index: int | None = None) -> None:
        if index is None:
            self.waiting.remove(request)
        else:
            del self.waiting[index]
        self._num_waiting_releasing -= not request.hold_blocks_on_finish

    def _start(self, request: Request, num_new: int, scheduled: dict[str, ScheduledRequest], budget: int) -> int:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled[request.request_id] = self._schedule_one(request, num_new)
        return budget - num_new

    # ---- room to run alone (see the module docstring) -----------------------------------------

    def _outside_owners(self, landed: bool = True) -> list[str]:
        """The requests whose blocks preempting running requests cannot free (pins aside)."""
        return [*self.reservations, *(r.request_id for r in self.landed if landed), *self.held]

    def _fits_alone(self, request: Request, shared: list = ()) -> bool:
        """See ``RoomAlone.fits``; a waiting request passes the prefix hits it would adopt."""
        return self.room.fits(request, self.room.outside(self._outside_owners()), shared)

    def _schedule_one(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new] + list(drafts),
            draft_token_ids=list(drafts),
            num_computed_tokens=start,
            block_ids=self.kv_manager.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids,
            stop_token_ids=request.stop_token_ids,
            grammar=request.grammar,
            output_token_ids=request.output_token_ids,
            table_row=self.kv_manager.table.row(request.request_id),
            prompt_logprob_rows=scored_rows(request.num_prompt_tokens, start, num_new, request.num_scored_tokens)
            if request.scores_prompt else (0, 0),
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
        self.kv_manager.free(victim.request_id)
        self.speculation.forget(victim.request_id)  # a draft model's KV went with the blocks
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(victim, front=True)

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Advance the requests of a finished step; returns those that produced a token or finished.

        ``sampled``: each sampling request's token, or the tokens of a speculating one (its accepted
        drafts, then one more); such a list is cut to the tokens taken when one of them ends it."""
        changed = []
        for item in out.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if item.draft_token_ids:
                self._take_verified(request, item, sampled[item.request_id])
            else:
                request.num_computed_tokens += len(item.token_ids)
                self.kv_manager.commit(request)
                if not item.sample:
                    continue
                token = sampled[item.request_id]
                self._append_token(request, token[0] if isinstance(token, list) else token)
            if request.is_finished:
                self._finish(request)
            changed.append(request)
        return changed

    def _take_verified(self, request: Request, item: ScheduledRequest, tokens: list[int]) -> None:
        """Append a speculating request's kept tokens; KV is valid for its last token and the
        accepted drafts, i.e. for every token now but the newest (the rest of the step's slots are
        written over later).  The tokens are appended before the commit, which hashes them."""
        self.speculation.record(request.request_id, len(item.draft_token_ids), len(tokens) - 1, request.num_tokens)
        taken = 0
        for token in tokens:
            self._append_token(request, token)
            taken += 1
            if request.is_finished:
                break
        del tokens[taken:]
        request.num_computed_tokens += taken
        self.kv_manager.commit(request)

    def _append_token(self, request: Request, token_id: int) -> None:
        request.append_token(token_id, self.config.max_model_len)

    # ---- leaving ---------------------------------------------------------------------------

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Finish a request now, wherever it is, and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.waiting:
            self._unqueue(request)
        if request in self.landed:
            self.landed.remove(request)
        request.status = status
        request.hold_blocks_on_finish = False
        self._finish(request)
        return request

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        del self.requests[request.request_id]
        if request is self.local_claim:
            self.local_claim = None  # the next request that cannot start claims
        if request is self._waited_a_step:
            self._waited_a_step = None
        self.handoff.decode.release(request.request_id)
        self.speculation.forget(request.request_id)
        if request.hold_blocks_on_finish:
            self.handoff.prefill.hold(request.request_id)
        else:
            self.kv_manager.free(request.request_id)

    def release_held(self, request_id: str) -> None:
        """Prefill role: the KV of a finished request has been shipped; its blocks become cache."""
        self.handoff.prefill.release(request_id)

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
        """Whether a step could do anything now: something runs, a landed request waits (admitted,
        or recomputed to make room), or a waiting request may start (with nothing running, the
        blocks it needs are free).  Requests waiting for remote KV, or for room that only blocks
        held outside ``running`` can give, do not count: the engine thread sleeps on ``False``."""
        if self.running or self.landed:
            return True
        passed_over = False
        releasing_left = self._num_waiting_releasing
        outside = self.room.outside(self._outside_owners()) if self.waiting else None
        for request in self.waiting:  # as ``_admit_waiting`` looks at them
            if passed_over and not releasing_left:
                return False
            releasing_left -= not request.hold_blocks_on_finish
            if passed_over and request.hold_blocks_on_finish:
                continue
            if self.room.fits(request, outside, self.kv_manager.find_cached_prefix(request)):
                return True
            passed_over = True
        return False

    def check_integrity(self) -> None:
        """Assert the scheduler's invariants (``scheduler_integrity.check_scheduler``)."""
        check_scheduler(self)
