"""Scheduler liveness: blocks held outside the running batch (reservations for remote KV, landed
requests, shipping pins) can never wedge the pool, and every request ends.

The property test drives one scheduler with random sequences of everything that can happen to it
(new prompts, reservations, KV landing, aborts, steps, leases ending, pins) on tiny pools, and
checks after every operation that every block reference has an owner, that a step only stalls
while blocks are held by something that will let go by itself (a lease, a transfer), and at the
end that every request finished and every block is free again.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.engine.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler

EOS = 2


def make(num_blocks=8, block_size=4, budget=16, max_seqs=4, watermark=0.125, remote_kv_budget=0.5, lease_s=10.0,
         claim_s=3.0):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                             watermark=watermark, remote_kv_budget=remote_kv_budget, remote_lease_s=lease_s,
                             remote_claim_s=claim_s)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size))


def req(rid, n_prompt, max_tokens=4, first=10):
    return Request(rid, [first + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s, token=5):
    out = s.schedule()
    s.update(out, {x.request_id: token for x in out.scheduled if x.sample})
    return out


def test_landed_requests_run_although_reservations_hold_the_rest_of_the_pool():
    """The deadlock of issue 8: with the watermark asked of remote-finished requests too, this
    reached ``running=0, waiting=2, free=1`` and stayed there."""
    s = make(num_blocks=8, block_size=4, watermark=0.125)
    assert s.reserve_remote(req("b", 12)) is not None  # 3 blocks
    s.finish_remote("b", 7)  # 13 tokens now: b needs a 4th block
    assert s.reserve_remote(req("a", 16, first=50)) is not None  # 4 blocks: one block left free
    assert s.kv.pool.num_free_blocks == 1
    s.finish_remote("a", 7)  # a needs a 5th block as well
    finished = set()
    for _ in range(50):
        run_step(s)
        finished |= {rid for rid in ("a", "b") if rid not in s.requests}
        if finished == {"a", "b"}:
            break
    assert finished == {"a", "b"}, f"stuck: running={len(s.running)} unfinished={s.num_unfinished} " \
                                   f"free={s.kv.pool.num_free_blocks}"
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    s.check_integrity()


def test_a_landed_request_that_cannot_grow_is_recomputed_instead_of_waiting_forever():
    s = make(num_blocks=8, block_size=4, watermark=0.0)
    s.reserve_remote(req("b", 16))  # the first reservation is allowed over the budget
    s.finish_remote("b", 7)  # b needs a 5th block
    assert s.reserve_remote(req("a", 16, first=50)) is not None  # the last 4 blocks
    assert s.kv.pool.num_free_blocks == 0
    out = s.schedule()
    assert out.preempted_request_ids == ["b"] and s.requests["b"].status == RequestStatus.PREEMPTED
    s.check_integrity()
    s.finish_remote("a", 7)
    for _ in range(60):
        run_step(s)
        s.check_integrity()
        if not s.requests:
            break
    assert not s.requests and s.kv.pool.num_free_blocks == 8


def test_reservations_stay_within_their_budget():
    s = make(num_blocks=16, block_size=4, watermark=0.0, remote_kv_budget=0.5)  # 8 blocks
    assert s.reserve_remote(req("a", 16)) is not None  # 4
    assert s.reserve_remote(req("b", 16, first=40)) is not None  # 8
    assert s.reserve_remote(req("c", 4, first=80)) is None  # would be 9
    s.add_request(req("local", 16, first=120))  # what the budget keeps free is for running requests
    assert [x.request_id for x in s.schedule().scheduled] == ["local"]
    s.finish_remote("a", 7)
    assert s.reserve_remote(req("c", 4, first=80)) is not None  # a landed: room in the budget again


def test_expired_leases_are_reported_once_and_refuse_late_kv():
    s = make(lease_s=5.0)
    s.reserve_remote(req("a", 4), now=100.0)
    s.reserve_remote(req("b", 4, first=40), lease_s=50.0, now=100.0)
    assert s.next_lease_deadline() == 105.0
    assert s.expired_leases(now=104.0) == []
    assert s.expired_leases(now=105.0) == ["a"]
    assert s.expired_leases(now=106.0) == []  # once
    assert s.next_lease_deadline() == 150.0
    assert s.finish_remote("a", 7) is None  # too late: the owner frees it
    assert s.kv.holds("a")  # ... only once no more bytes can land, so not here
    s.abort("a")
    s.check_integrity()
    assert s.finish_remote("b", 7) is not None


def test_a_long_reservation_is_not_starved_by_short_ones():
    """Short reservations keep coming as room frees; the long one refused first gets the room."""
    s = make(num_blocks=16, block_size=4, watermark=0.0, remote_kv_budget=0.5)  # 8 blocks of budget
    assert s.reserve_remote(req("a", 8), now=0.0) is not None  # 2 blocks
    assert s.reserve_remote(req("b", 8, first=40), now=0.0) is not None  # 4
    assert s.reserve_remote(req("long", 24, first=80), now=0.0) is None  # 6 more: over the budget
    assert s.claim.request_id == "long" and s.claim.num_blocks == 6
    assert s.reserve_remote(req("c", 8, first=120), now=1.0) is None  # fits the budget, but is the long one's
    s.finish_remote("a", 7)  # 2 blocks of budget free again: before, "c" would take them
    assert s.reserve_remote(req("c", 8, first=120), now=2.0) is None
    assert s.claim.request_id == "long"  # the oldest keeps the claim
    assert s.reserve_remote(req("long", 24, first=80), now=2.5) is not None  # the gateway's retry: 2 + 6 = 8
    assert s.claim is None
    s.check_integrity()


def test_small_reservations_that_leave_the_claimant_its_room_go_ahead():
    s = make(num_blocks=16, block_size=4, budget=64, watermark=0.0, remote_kv_budget=1.0)
    for i in range(3):
        s.add_request(req(f"run{i}", 16, first=20 * i))  # 12 blocks held by running requests
    run_step(s), run_step(s)
    assert s.kv.pool.num_free_blocks == 16 - 15  # each has its 5th block
    assert s.reserve_remote(req("long", 12, first=100), now=0.0) is None  # 3 blocks, 1 free
    assert s.reserve_remote(req("tiny", 1, first=150), now=0.0) is None  # would take the claimant's block
    s.abort("run0")  # 6 blocks free: the claimant needs 3 of them
    assert s.reserve_remote(req("tiny", 1, first=150), now=0.5) is not None  # leaves the claimant 5
    assert s.reserve_remote(req("tiny2", 12, first=160), now=0.5) is None  # 3 blocks: would leave 2
    assert s.reserve_remote(req("long", 12, first=100), now=1.0) is not None
    s.check_integrity()


def test_a_claim_whose_request_never_comes_back_expires():
    s = make(num_blocks=16, block_size=4, watermark=0.0, remote_kv_budget=0.5, claim_s=3.0)
    assert s.reserve_remote(req("a", 16), now=0.0) is not None  # 4 blocks
    assert s.reserve_remote(req("long", 24, first=80), now=0.0) is None  # claims 6
    assert s.reserve_remote(req("c", 8, first=120), now=2.9) is None
    assert s.reserve_remote(req("c", 8, first=120), now=3.0) is not None  # the claim ended: no deadlock
    s.check_integrity()


def test_a_prompt_larger_than_the_reservation_budget_is_served_once_it_is_first_in_line():
    """12 blocks on a 16-block pool with an 8-block budget: allowed only alone; the claim makes the
    other reservations drain instead of always keeping one held."""
    s = make(num_blocks=16, block_size=4, watermark=0.125, remote_kv_budget=0.5)
    assert s.reserve_remote(req("a", 8), now=0.0) is not None
    assert s.reserve_remote(req("long", 48, first=80), now=0.0) is None  # 12 blocks, not alone
    assert s.reserve_remote(req("b", 4, first=120), now=0.5) is None  # even one block would block it
    s.finish_remote("a", 7)
    while "a" in s.requests:
        run_step(s)
    # Nothing else holds blocks: the whole pool is there (no watermark), 12 of 16 blocks.
    assert s.reserve_remote(req("long", 48, first=80), now=1.0) is not None
    s.check_integrity()


def test_integrity_check_finds_an_unowned_reference():
    s = make()
    s.add_request(req("a", 6))
    run_step(s)
    s.check_integrity()
    s.kv.pool.touch([s.kv.req_to_blocks["a"][0]])  # a reference nobody owns
    with pytest.raises(AssertionError, match="owners"):
        s.check_integrity()


# ---- the property test -----------------------------------------------------------------------

OPS = st.sampled_from(["add", "add", "reserve", "reserve", "land", "land", "abort", "step", "step", "step",
                       "tick", "prefill", "unpin", "retry"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(3, 12), block_size=st.integers(1, 4), budget=st.integers(1, 12),
    max_seqs=st.integers(1, 4), watermark=st.sampled_from([0.0, 0.1, 0.3]),
    remote_kv_budget=st.sampled_from([0.2, 0.5, 1.0]),
    ops=st.lists(st.tuples(OPS, st.integers(0, 1 << 16)), min_size=10, max_size=100),
)
def test_every_request_ends_and_every_block_comes_back(num_blocks, block_size, budget, max_seqs, watermark,
                                                       remote_kv_budget, ops):
    s = make(num_blocks, block_size, budget, max_seqs, watermark, remote_kv_budget, lease_s=30.0)
    now = 0.0
    ids = iter(range(1 << 30))
    pins: list[list] = []  # batches of shipped blocks, oldest first
    started: set[str] = set()
    refused: list[tuple[str, list[int], int]] = []  # reservations refused: the gateway may retry them

    def new_request(arg, max_tokens=None):
        n_prompt = 1 + arg % (2 * block_size * num_blocks // 3 + 1)
        first = (arg >> 8) % 3 * 4  # few distinct prompts: prefix hits happen
        max_tokens = max_tokens or 1 + (arg >> 10) % 6
        request = Request(f"r{next(ids)}", [first + i for i in range(n_prompt)],
                          SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,))
        return request

    def ship_finished():
        for rid in list(s.held):  # what the prefill role's shipper does after a step
            pins.append(list(s.kv.req_to_blocks.get(rid, [])))
            s.kv.pin(pins[-1])
            s.release_held(rid)

    def step(arg):
        out = s.schedule()
        s.update(out, {x.request_id: EOS if (arg + len(x.token_ids)) % 7 == 0 else 5
                       for x in out.scheduled if x.sample})
        ship_finished()
        if out.is_empty and not out.preempted_request_ids:
            # Stalled: only while blocks are held by something that lets go by itself.
            assert s.reservations or pins or not s.has_work(), (
                f"stalled with work and nothing to wait for: running={len(s.running)} "
                f"waiting={s.num_waiting} free={s.kv.pool.num_free_blocks}")
        return out

    for op, arg in ops:
        if op in ("add", "prefill"):
            request = new_request(arg, max_tokens=1 if op == "prefill" else None)
            request.hold_blocks_on_finish = op == "prefill"
            try:
                s.add_request(request)
                started.add(request.request_id)
            except ValueError:
                pass
        elif op in ("reserve", "retry"):
            if op == "retry" and refused:  # the same request id again (the claimant, maybe)
                rid, prompt, max_tokens = refused.pop(arg % len(refused))
                request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,))
            else:
                request = new_request(arg)
            claim = s.claim if s.claim is not None and s.claim.expires > now else None
            try:
                reserved = s.reserve_remote(request, now=now)
            except ValueError:
                continue
            if reserved is not None:
                started.add(request.request_id)
                if claim is not None and claim.request_id != request.request_id:
                    # Nobody else takes the claimant's room while its claim lasts.
                    assert s.num_reserved_blocks + claim.num_blocks <= s._remote_budget_blocks
                    assert s.kv.pool.num_free_blocks - s._watermark_blocks >= claim.num_blocks
            else:
                refused.append((request.request_id, request.prompt_token_ids, request.sampling_params.max_tokens))
        elif op == "land" and s.reservations:
            rid = list(s.reservations)[arg % len(s.reservations)]
            s.finish_remote(rid, EOS if arg % 5 == 0 else 5)
        elif op == "abort" and s.requests:
            s.abort(list(s.requests)[arg % len(s.requests)])
        elif op == "step":
            step(arg)
        elif op == "tick":
            now += arg % 40
            for rid in s.expired_leases(now):  # the owner frees it once the transfer settled
                s.abort(rid)
        elif op == "unpin" and pins:
            s.kv.unpin(pins.pop(0))
        s.check_integrity()

    # Drain: transfers finish (or time out), pins are sent; then every request must end.
    for i, rid in enumerate(list(s.reservations)):
        if i % 2:
            s.finish_remote(rid, 5)
    for rid in s.expired_leases(now + 1e9):
        s.abort(rid)
    while pins:
        s.kv.unpin(pins.pop())
    for n in range(5000):
        if not s.requests:
            break
        step(n)
        while pins:
            s.kv.unpin(pins.pop())
        s.check_integrity()
    assert not s.requests, f"never finished: {list(s.requests.values())}"
    assert not s.held and not s.kv.pins
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks  # only cached blocks remain
    # A claimant that comes back is served once the others are gone (however large: it fits the pool).
    if s.claim is not None and s.claim.expires > now:
        rid = s.claim.request_id
        rid, prompt, max_tokens = next(r for r in reversed(refused) if r[0] == rid)
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,))
        assert s.reserve_remote(request, now=now) is not None, "the claimant was never served"
        assert s.claim is None
        s.check_integrity()
