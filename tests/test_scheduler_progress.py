"""Scheduler liveness as a property: progress, not just non-empty steps.

A hypothesis state machine drives one scheduler on tiny pools with everything that can happen to
it: local prompts, prefill-role prompts (blocks held on finish, then pinned while shipped),
reservations for remote KV that land on time, late, never, or after their lease ended (the owner
then frees them: ``expired_leases`` + ``abort``, as the decode worker does), retries of refused
reservations, aborts, unpins, and steps.  After every operation the scheduler's invariants hold
(``check_integrity``).  The property:

    whenever some request could run alone in the blocks not held outside ``running`` (see
    ``could_run_alone``: the oracle below, written from the definition, not from the scheduler),
    within a bounded number of steps some request gains a token or ends.

The count of steps without progress restarts only when a reservation is granted (it may take the
room a request was using, a legitimate setback) or when something ends or lands (progress).  A
prefill-role prompt queued behind a request that waits for room is not counted as one that could
run: it would add held blocks to what that request waits for, so it waits too (the scheduler's
docstring).  Runs with prefix caching on and off.  Before the fix, a chunked prompt that needed
more than the room left beside reservations preempted itself forever while others waited.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from common.engine.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler

EOS = 2
LEASE_S = 30.0
FATES = ("land", "late", "never")  # what becomes of a granted reservation's KV
SHAPES = st.tuples(st.integers(0, 31), st.integers(0, 2), st.integers(1, 6))  # length, prefix, max_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def outside_running(s: Scheduler) -> set[int]:
    """Blocks that preempting every running request would not free."""
    ids = set(s.kv.pins)
    for rid in [*s.reservations, *(r.request_id for r in s.landed), *s.held]:
        ids.update(block.block_id for block in s.kv.req_to_blocks.get(rid, ()))
    return ids


def could_run_alone(s: Scheduler, request: Request, outside: set[int]) -> bool:
    """All its tokens' KV fits in the pool minus the outside blocks it does not hold or share."""
    own = s.kv.req_to_blocks.get(request.request_id) or s.kv.find_cached_prefix(request)
    room = s.kv.pool.num_blocks - len(outside - {block.block_id for block in own})
    return cdiv(request.num_tokens, s.kv.block_size) <= room


def some_request_could_run(s: Scheduler) -> bool:
    outside = outside_running(s)
    if any(could_run_alone(s, r, outside) for r in [*s.running, *s.landed]):
        return True
    waiting_for_room = False
    for request in s.waiting:
        if not could_run_alone(s, request, outside):
            waiting_for_room = True
        elif not (waiting_for_room and request.hold_blocks_on_finish):
            return True
    return False


class SchedulerMachine(RuleBasedStateMachine):
    caching = True  # set by the subclasses below

    @initialize(num_blocks=st.integers(3, 12), block_size=st.integers(1, 4), budget=st.integers(1, 12),
                max_seqs=st.integers(1, 4), watermark=st.sampled_from([0.0, 0.1, 0.3]),
                remote_kv_budget=st.sampled_from([0.2, 0.5, 1.0]))
    def start(self, num_blocks, block_size, budget, max_seqs, watermark, remote_kv_budget):
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                                 watermark=watermark, remote_kv_budget=remote_kv_budget,
                                 remote_lease_s=LEASE_S, remote_claim_s=3.0)
        self.s = Scheduler(config, KVCacheManager(BlockPool(num_blocks, enable_caching=self.caching), block_size))
        self.now = 0.0
        self.steps = 0
        self.ids = 0
        self.fates: dict[str, tuple[str, int]] = {}  # reservation -> (fate, the step its KV arrives)
        self.refused: list[Request] = []  # reservations refused: the gateway may retry them
        self.pins: list[list] = []  # batches of shipped blocks, oldest first
        self.stale = 0  # steps in a row in which some request could run and none progressed

    # ---- what happens to the scheduler ------------------------------------------------------

    def new_request(self, shape: tuple[int, int, int]) -> Request:
        """A prompt of up to 2/3 of the pool; few distinct ones, so prefix hits happen."""
        length, prefix, max_tokens = shape
        n_prompt = 1 + length % (2 * self.s.block_size * self.s.kv.pool.num_blocks // 3 + 1)
        self.ids += 1
        return Request(f"r{self.ids}", [4 * prefix + i for i in range(n_prompt)],
                       SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,))

    @rule(shape=SHAPES, prefill=st.booleans())
    def add(self, shape, prefill):
        request = self.new_request((shape[0], shape[1], 1) if prefill else shape)
        request.hold_blocks_on_finish = prefill  # the prefill role ships the prompt's KV once computed
        try:
            self.s.add_request(request)
        except ValueError:
            pass
        self.s.check_integrity()

    @rule(shape=SHAPES, fate=st.sampled_from(FATES), delay=st.integers(0, 6), retry=st.integers(-1, 3))
    def reserve(self, shape, fate, delay, retry):
        s = self.s
        if retry >= 0 and self.refused:
            old = self.refused.pop(retry % len(self.refused))  # the same request id again
            request = Request(old.request_id, old.prompt_token_ids, old.sampling_params, eos_token_ids=(EOS,))
        else:
            request = self.new_request(shape)
        claim = s.claim if s.claim is not None and s.claim.expires > self.now else None
        try:
            reserved = s.reserve_remote(request, now=self.now)
        except ValueError:
            return
        if reserved is None:
            self.refused.append(request)
        else:
            self.stale = 0  # it may take room a request was using: a legitimate setback
            self.fates[request.request_id] = (fate, self.steps + delay)
            if claim is not None and claim.request_id != request.request_id:
                # Nobody else takes the room of the oldest refused reservation while its claim lasts.
                assert s.num_reserved_blocks + claim.num_blocks <= s._remote_budget_blocks
                assert s.kv.pool.num_free_blocks - s._watermark_blocks >= claim.num_blocks
        s.check_integrity()

    @rule(index=st.integers(0, 15))
    def abort(self, index):
        if self.s.requests:
            self.s.abort(list(self.s.requests)[index % len(self.s.requests)])
            self.stale = 0
        self.s.check_integrity()

    @rule(dt=st.integers(0, 40))
    def tick(self, dt):
        """Time passes; expired leases are freed by their owner, once no more bytes can land."""
        self.now += dt
        for rid in self.s.expired_leases(self.now):
            if self.fates.pop(rid, ("never", 0))[0] == "late":
                assert self.s.finish_remote(rid, 5) is None, "KV accepted after its lease ended"
            self.s.abort(rid)
            self.stale = 0
        self.s.check_integrity()

    @rule()
    def unpin(self):
        if self.pins:
            self.s.kv.unpin(self.pins.pop(0))
        self.s.check_integrity()

    @rule(n=st.integers(1, 3))
    def steps_(self, n):
        for _ in range(n):
            self.step()

    @rule()
    def settle(self):
        """Steps in a row, with nothing from outside but KV landing: more than the bound allows
        without progress, from wherever the count stands."""
        for _ in range(2 * self.bound() + 1):
            if not self.s.requests:
                return
            self.step()

    # ---- one step, and the property ---------------------------------------------------------

    def bound(self) -> int:
        """Steps without progress allowed while some request could run: every request may have to
        preempt itself (or be recomputed) once, then the oldest that can run computes its tokens a
        chunk a step; twice that, to be generous."""
        s = self.s
        longest = max((r.num_tokens for r in s.requests.values()), default=0)
        return 2 * (len(s.requests) + cdiv(longest, s.config.max_num_batched_tokens) + 2)

    def land_due(self) -> None:
        """KV that arrives now: on time it lands; late, after its lease, it is refused (tick frees it)."""
        for rid, (fate, due) in list(self.fates.items()):
            if fate == "land" and due <= self.steps and rid in self.s.reservations:
                del self.fates[rid]
                if self.s.finish_remote(rid, EOS if due % 5 == 0 else 5) is not None:
                    self.stale = 0  # it gained its first token (or ended)

    def step(self) -> None:
        s = self.s
        self.land_due()
        could_run = some_request_could_run(s)
        idle = not s.has_work()
        out = s.schedule()
        assert not idle or (out.is_empty and not out.preempted_request_ids), (
            "has_work() said no step could do anything, but one did: the engine thread would sleep through it")
        ended_before = len(s.requests)
        changed = s.update(out, {x.request_id: EOS if (self.steps + len(x.token_ids)) % 7 == 0 else 5
                                 for x in out.scheduled if x.sample})
        self.steps += 1
        for rid in list(s.held):  # what the prefill role's shipper does after a step
            self.pins.append(list(s.kv.req_to_blocks.get(rid, [])))
            s.kv.pin(self.pins[-1])
            s.release_held(rid)
        s.check_integrity()
        if changed or len(s.requests) < ended_before:
            self.stale = 0
        elif could_run:
            self.stale += 1
            assert self.stale <= self.bound(), (
                f"no request gained a token or ended in {self.stale} steps although one could run "
                f"alone: running={s.running} waiting={list(s.waiting)} landed={list(s.landed)} "
                f"reserved={list(s.reservations)} pins={len(s.kv.pins)} free={s.kv.pool.num_free_blocks}")
        else:
            self.stale = 0

    def teardown(self):
        """Reservations that never land keep holding blocks while the rest must still progress;
        then every lease ends, every pin is sent, and every request must finish."""
        if not hasattr(self, "s"):
            return
        s = self.s
        self.settle()
        for rid, (fate, _) in list(self.fates.items()):
            if fate == "land" and rid in s.reservations:
                self.fates[rid] = (fate, self.steps)
        self.land_due()
        for rid in s.expired_leases(self.now + LEASE_S + 1):  # (the claim below is judged at self.now)
            if self.fates.pop(rid, ("never", 0))[0] == "late":
                assert s.finish_remote(rid, 5) is None, "KV accepted after its lease ended"
            s.abort(rid)
        while self.pins:
            s.kv.unpin(self.pins.pop())
        self.stale = 0  # all that held blocks outside running let go at once: a new count
        for _ in range(5000):
            if not s.requests:
                break
            self.step()
            while self.pins:
                s.kv.unpin(self.pins.pop())
        assert not s.requests, f"never finished: {list(s.requests.values())}"
        assert not s.held and not s.kv.pins
        assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks  # only cached blocks remain
        s.check_integrity()
        # The oldest refused reservation, if its claim lasts, is served when it comes back (however
        # large: it fits the pool).
        old = next((r for r in self.refused if s.claim and r.request_id == s.claim.request_id), None)
        if old is not None and s.claim.expires > self.now:
            request = Request(old.request_id, old.prompt_token_ids, old.sampling_params, eos_token_ids=(EOS,))
            assert s.reserve_remote(request, now=self.now) is not None, "the claimant was never served"
            assert s.claim is None
            s.check_integrity()


class WithPrefixCaching(SchedulerMachine):
    caching = True


class WithoutPrefixCaching(SchedulerMachine):
    caching = False


# Under mutation testing (mutmut sets MUTANT_UNDER_TEST) only whether the test fails counts: no shrinking.
_PHASES = tuple(p for p in Phase if p not in (Phase.shrink, Phase.explain)) if os.environ.get("MUTANT_UNDER_TEST") \
    else tuple(Phase)
SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, report_multiple_bugs=False,
                    phases=_PHASES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("machine", [WithPrefixCaching, WithoutPrefixCaching],
                         ids=["prefix-caching", "no-prefix-caching"])
def test_some_request_progresses_whenever_one_could_run(machine):
    run_state_machine_as_test(machine, settings=SETTINGS)
