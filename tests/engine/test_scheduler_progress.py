"""Scheduler liveness as a property: progress, not just non-empty steps.

A hypothesis state machine drives one scheduler on tiny pools with everything that can happen to
it: local prompts, prefill-role prompts (blocks held on finish, then pinned while shipped),
reservations for remote KV that land on time, late, never, or after their lease ended (the owner
then frees them: ``expired_leases`` + ``abort``, as the decode worker does), retries of refused
reservations, aborts, unpins, and steps.  After every operation the scheduler's invariants hold
(``check_integrity``).  Steps are taken as the engine thread takes them: only while ``has_work()``
(and then a step on a copy of the scheduler must do nothing).  The properties:

    progress: whenever some request could run alone in the blocks not held outside ``running``
    (see ``could_run_alone``: the oracle below, written from the definition, not from the
    scheduler), within a bounded number of steps some request gains a token or ends;

    no starvation: the oldest waiting request that could run alone gains a token (or ends)
    within a bound set by the work ahead of it -- however many reservations are granted meanwhile.

The first count restarts when a reservation is granted (it may take the room a request was using,
a legitimate setback) or when something ends or lands (progress); the second only when that
request gains a token, so reservations granted again and again are seen (``steady``: one or two
offered before every step, their KV landing at once or a few steps later).  A prefill-role
prompt queued behind a request that waits for room is not counted as one that could run: it
would add held blocks to what that request waits for, so it waits too (the scheduler's
docstring).  Runs with prefix caching on and off, and with speculation (drafts on every decode
step, some accepted: the extra slots are taken only where free, never by preempting).  And every
step, each decoding request that is not preempted computes its token (drafts are what the running
requests' tokens leave: they took every token of the step from the requests behind them).  Before the fix, a chunked prompt that needed
more than the room left beside reservations preempted itself forever while others waited; and
then, reservations granted before every step starved a waiting prompt that fit alone.
"""
from __future__ import annotations

import copy
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from common.engine.kv.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.scheduler_output import SchedulerOutput
from common.engine.speculative.speculation import Speculation, SpeculativeConfig

pytestmark = pytest.mark.slow(seconds=25)  # a long file: scheduled by its length (tests/conftest.py)

EOS = 2
LEASE_S = 30.0
FATES = ("land", "late", "never")  # what becomes of a granted reservation's KV
SHAPES = st.tuples(st.integers(0, 31), st.integers(0, 2), st.integers(1, 6))  # length, prefix, max_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def outside_running(s: Scheduler) -> set[int]:
    """Blocks that preempting every running request would not free."""
    ids = set(s.kv_manager.pins)
    for rid in [*s.reservations, *(r.request_id for r in s.landed), *s.held]:
        ids.update(block.block_id for block in s.kv_manager.req_to_blocks.get(rid, ()))
    return ids


def could_run_alone(s: Scheduler, request: Request, outside: set[int]) -> bool:
    """All its tokens' KV fits in the pool minus the outside blocks it does not hold or share."""
    own = s.kv_manager.req_to_blocks.get(request.request_id) or s.kv_manager.find_cached_prefix(request)
    room = s.kv_manager.pool.num_blocks - len(outside - {block.block_id for block in own})
    return cdiv(request.num_tokens, s.kv_manager.block_size) <= room


def waiting_that_could_run(s: Scheduler) -> list[Request]:
    """Waiting requests that could run alone, oldest first, but those that would hold blocks on
    finish queued behind one that cannot (what it waits for)."""
    outside = outside_running(s)
    found, waiting_for_room = [], False
    for request in s.waiting:
        if not could_run_alone(s, request, outside):
            waiting_for_room = True
        elif not (waiting_for_room and request.hold_blocks_on_finish):
            found.append(request)
    return found


def some_request_could_run(s: Scheduler) -> bool:
    outside = outside_running(s)
    return any(could_run_alone(s, r, outside) for r in [*s.running, *s.landed]) or bool(waiting_that_could_run(s))


class SchedulerMachine(RuleBasedStateMachine):
    caching = True  # set by the subclasses below
    speculating = False

    @initialize(num_blocks=st.integers(3, 12), block_size=st.integers(1, 4), budget=st.integers(1, 12),
                max_seqs=st.integers(1, 4), watermark=st.sampled_from([0.0, 0.1, 0.3]),
                remote_kv_budget=st.sampled_from([0.2, 0.5, 1.0]))
    def start(self, num_blocks, block_size, budget, max_seqs, watermark, remote_kv_budget):
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                                 watermark=watermark, remote_kv_budget=remote_kv_budget,
                                 remote_lease_s=LEASE_S, remote_claim_s=3.0)
        speculation = None
        if self.speculating:  # drafts from a stub, some accepted, some not: never backing off
            speculation = Speculation(SpeculativeConfig("ngram", num_tokens=3, min_accepted=0.0, cost_gate=False), 256)
            speculation.proposer = CountingProposer()
        self.s = Scheduler(config, KVCacheManager(BlockPool(num_blocks, enable_caching=self.caching), block_size),
                           speculation)
        self.now = 0.0
        self.steps = 0
        self.ids = 0
        self.fates: dict[str, tuple[str, int]] = {}  # reservation -> (fate, the step its KV arrives)
        self.refused: list[Request] = []  # reservations refused: the gateway may retry them
        self.pins: list[list] = []  # batches of shipped blocks, oldest first
        self.stale = 0  # steps in a row in which some request could run and none progressed
        # The oldest waiting request that could run, once seen: (its outputs then, steps it has
        # waited since while it could run, the largest wait the work ahead allowed meanwhile),
        # until it gains a token or ends.
        self.watched: dict[str, tuple[int, int, int]] = {}
        self.idle_verified = False  # a step on a copy did nothing, and nothing happened since

    def check(self) -> None:
        """After something happened to the scheduler: its invariants hold."""
        self.s.check_integrity()
        self.idle_verified = False

    # ---- what happens to the scheduler ------------------------------------------------------

    def new_request(self, shape: tuple[int, int, int]) -> Request:
        """A prompt of up to 2/3 of the pool; few distinct ones, so prefix hits happen."""
        length, prefix, max_tokens = shape
        n_prompt = 1 + length % (2 * self.s.block_size * self.s.kv_manager.pool.num_blocks // 3 + 1)
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
        self.check()

    @rule(shape=SHAPES, fate=st.sampled_from(FATES), delay=st.integers(0, 6), retry=st.integers(-1, 3))
    def reserve(self, shape, fate, delay, retry):
        s = self.s
        if retry >= 0 and self.refused:
            old = self.refused.pop(retry % len(self.refused))  # the same request id again
            request = Request(old.request_id, old.prompt_token_ids, old.sampling_params, eos_token_ids=(EOS,))
        else:
            request = self.new_request(shape)
        claim = s.remote_claim if s.remote_claim is not None and s.remote_claim.expires > self.now else None
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
                assert s.num_reserved_blocks + claim.num_blocks <= s.handoff.decode.budget_blocks
                assert s.kv_manager.pool.num_free_blocks - s._watermark_blocks >= claim.num_blocks
        self.check()

    @rule(n=st.integers(1, 50), per_step=st.integers(1, 2), size=st.integers(1, 8), delay=st.integers(0, 3))
    def steady(self, n, per_step, size, delay):
        """Steady remote traffic: ``per_step`` reservations of ``size`` tokens offered before each
        of ``n`` steps, their KV landing ``delay`` steps later (as the gateway keeps a decode
        worker busy while a local prompt waits)."""
        for _ in range(n):
            for _ in range(per_step):
                self.ids += 1
                request = Request(f"r{self.ids}", [100 + (self.ids % 7) * 8 + i for i in range(size)],
                                  SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
                try:
                    if self.s.reserve_remote(request, now=self.now) is not None:
                        self.stale = 0
                        self.fates[request.request_id] = ("land", self.steps + delay)
                        self.idle_verified = False
                except ValueError:
                    pass
            self.step()

    @rule(index=st.integers(0, 15))
    def abort(self, index):
        if self.s.requests:
            self.s.abort(list(self.s.requests)[index % len(self.s.requests)])
            self.stale = 0
        self.check()

    @rule(dt=st.integers(0, 40))
    def tick(self, dt):
        """Time passes; expired leases are freed by their owner, once no more bytes can land."""
        self.now += dt
        for rid in self.s.expired_leases(self.now):
            if self.fates.pop(rid, ("never", 0))[0] == "late":
                assert self.s.finish_remote(rid, 5) is None, "KV accepted after its lease ended"
            self.s.abort(rid)
            self.stale = 0
        self.check()

    @rule()
    def unpin(self):
        if self.pins:
            self.s.kv_manager.unpin(self.pins.pop(0))
        self.check()

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

    def work_ahead_bound(self, request: Request) -> int:
        """Steps ``request`` may wait, as the oldest waiting request that could run, before it gains
        a token: what is ahead of it (running, landed and reserved requests, waiting ones before
        it) may run to its end, and it computes its own tokens a chunk a step; twice that, each
        request perhaps preempted once more."""
        s = self.s
        budget = s.config.max_num_batched_tokens
        waiting = list(s.waiting)
        before = waiting[:waiting.index(request)] if request in waiting else []
        ahead = [*s.running, *s.landed, *s.reservations.values(), *before]
        work = sum(2 * cdiv(r.num_tokens, budget) + r.sampling_params.max_tokens + 2 for r in ahead if r is not request)
        return 2 * (work + 2 * cdiv(request.num_tokens, budget) + 7 + 6)  # 6: the longest KV delay

    def watch(self) -> None:
        """Start watching the oldest waiting request that could run (see ``count_waits``)."""
        could_run = waiting_that_could_run(self.s)
        if could_run and could_run[0].request_id not in self.watched:
            self.watched[could_run[0].request_id] = (could_run[0].num_output_tokens, 0, 0)

    def count_waits(self) -> None:
        """After a step: each watched request that gained no token and could still run (or runs)
        has waited one more step; it may not wait longer than the work ahead of it allows -- the
        most there was at any step of its wait (work ahead that ends meanwhile was still waited for)."""
        s = self.s
        could_run = {r.request_id for r in waiting_that_could_run(s)} | {r.request_id for r in s.running}
        for rid, (outputs, waited, bound) in list(self.watched.items()):
            request = s.requests.get(rid)
            if request is None or request.num_output_tokens > outputs:
                del self.watched[rid]  # it ended, or gained a token
            elif rid in could_run:
                waited += 1
                bound = max(bound, self.work_ahead_bound(request))
                self.watched[rid] = (outputs, waited, bound)
                assert waited <= bound, (
                    f"{rid} waited {waited} steps without a token although it could run: running={s.running} "
                    f"waiting={list(s.waiting)} landed={list(s.landed)} reserved={list(s.reservations)} "
                    f"free={s.kv_manager.pool.num_free_blocks}")

    def land_due(self) -> None:
        """KV that arrives now: on time it lands; late, after its lease, it is refused (tick frees it)."""
        for rid, (fate, due) in list(self.fates.items()):
            if fate == "land" and due <= self.steps and rid in self.s.reservations:
                del self.fates[rid]
                self.idle_verified = False
                if self.s.finish_remote(rid, EOS if due % 5 == 0 else 5) is not None:
                    self.stale = 0  # it gained its first token (or ended)

    def step(self) -> None:
        s = self.s
        self.land_due()
        could_run = some_request_could_run(s)
        self.watch()
        if s.has_work():
            decoding = [r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1]
            out = s.schedule()
            self.idle_verified = False
            for item in out.scheduled:  # every token computed (drafts too) has its KV slot
                assert len(item.block_ids) * s.block_size >= item.num_computed_tokens + len(item.token_ids), item
            # Every decoding request not preempted has its token: none is left out step after step
            # (by the drafts of those before it, or a batch of more requests than the step's tokens).
            stepped = {item.request_id for item in out.scheduled} | set(out.preempted_request_ids)
            assert stepped.issuperset(decoding), (decoding, out.scheduled, s.config)
        else:  # the engine thread takes no step: one would do nothing (tried on a copy, once)
            if not self.idle_verified:
                out = copy.deepcopy(s).schedule()
                assert out.is_empty and not out.preempted_request_ids, (
                    "has_work() said no step could do anything, but one did: the engine thread would sleep through it")
                self.idle_verified = True
            out = SchedulerOutput()
        ended_before = len(s.requests)
        changed = s.update(out, {x.request_id: self.sampled(x) for x in out.scheduled if x.sample})
        self.steps += 1
        for rid in list(s.held):  # what the prefill role's shipper does after a step
            self.pins.append(list(s.kv_manager.req_to_blocks.get(rid, [])))
            s.kv_manager.pin(self.pins[-1])
            s.release_held(rid)
        s.check_integrity()
        self.count_waits()
        if changed or len(s.requests) < ended_before:
            self.stale = 0
        elif could_run:
            self.stale += 1
            assert self.stale <= self.bound(), (
                f"no request gained a token or ended in {self.stale} steps although one could run "
                f"alone: running={s.running} waiting={list(s.waiting)} landed={list(s.landed)} "
                f"reserved={list(s.reservations)} pins={len(s.kv_manager.pins)} free={s.kv_manager.pool.num_free_blocks}")
        else:
            self.stale = 0

    def sampled(self, item) -> int | list[int]:
        """What a step samples for ``item``: one token, or some of its drafts and one more."""
        token = EOS if (self.steps + len(item.token_ids)) % 7 == 0 else 5
        if not item.draft_token_ids:
            return token
        return [*item.draft_token_ids[: (self.steps + item.num_computed_tokens) % (len(item.draft_token_ids) + 1)], token]

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
            s.kv_manager.unpin(self.pins.pop())
        self.idle_verified = False
        self.stale = 0  # all that held blocks outside running let go at once: a new count
        for _ in range(5000):
            if not s.requests:
                break
            self.step()
            while self.pins:
                s.kv_manager.unpin(self.pins.pop())
                self.idle_verified = False
        assert not s.requests, f"never finished: {list(s.requests.values())}"
        assert not s.held and not s.kv_manager.pins
        assert s.kv_manager.pool.num_free_blocks == s.kv_manager.pool.num_blocks  # only cached blocks remain
        s.check_integrity()
        # The oldest refused reservation, if its claim lasts, is served when it comes back (however
        # large: it fits the pool).
        old = next((r for r in self.refused if s.remote_claim and r.request_id == s.remote_claim.request_id), None)
        if old is not None and s.remote_claim.expires > self.now:
            request = Request(old.request_id, old.prompt_token_ids, old.sampling_params, eos_token_ids=(EOS,))
            assert s.reserve_remote(request, now=self.now) is not None, "the claimant was never served"
            assert s.remote_claim is None
            s.check_integrity()


class WithPrefixCaching(SchedulerMachine):
    caching = True


class WithoutPrefixCaching(SchedulerMachine):
    caching = False


class WithSpeculation(SchedulerMachine):
    caching = True
    speculating = True


class CountingProposer:
    """Up to three drafts (3, 4, 5 ...) for every request, as many as its length allows."""

    def propose(self, request, num_tokens, block_ids):
        return [3 + i for i in range(min(num_tokens, request.num_tokens % 4))]

    def forget(self, request_id):
        pass


# Under mutation testing (mutmut sets MUTANT_UNDER_TEST) only whether the test fails counts: no shrinking.
_PHASES = tuple(p for p in Phase if p not in (Phase.shrink, Phase.explain)) if os.environ.get("MUTANT_UNDER_TEST") \
    else tuple(Phase)
SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, report_multiple_bugs=False,
                    phases=_PHASES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("machine", [WithPrefixCaching, WithoutPrefixCaching, WithSpeculation],
                         ids=["prefix-caching", "no-prefix-caching", "speculation"])
def test_some_request_progresses_whenever_one_could_run(machine):
    # The speculation variant shares the machine's other rules: fewer examples cover what it adds.
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=50) if machine.speculating else SETTINGS)
