"""Scheduler liveness: blocks held outside the running batch (reservations for remote KV, landed
requests, shipping pins) can never wedge the pool, and every request ends.

Each test names the fix it proves and fails with that fix reverted.  The property test (progress
whenever a request could run, with random sequences of everything that can happen to a
scheduler) is ``test_scheduler_progress.py``; the livelock of issue 27 is ``test_scheduler_livelock.py``.
"""
import pytest

from common.engine.kv.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager
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
    reached ``running=0, waiting=2, free=1`` and stayed there.  Fixed by admitting landed requests
    without the watermark: b takes the last free block at once, and nothing is recomputed (before,
    or with that rule reverted, b waited for the watermark, forever or until a was recomputed)."""
    s = make(num_blocks=8, block_size=4, watermark=0.125)  # a watermark of 1 block
    assert s.reserve_remote(req("b", 12)) is not None  # 3 blocks
    s.finish_remote("b", 7)  # 13 tokens now: b needs a 4th block
    assert s.reserve_remote(req("a", 16, first=50)) is not None  # 4 blocks: one block left free
    assert s.kv_manager.pool.num_free_blocks == 1
    s.finish_remote("a", 7)  # a needs a 5th block as well
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["b"], f"b was not admitted: {out}"
    finished = set()
    for _ in range(50):
        finished |= {rid for rid in ("a", "b") if rid not in s.requests}
        if finished == {"a", "b"}:
            break
        run_step(s)
    assert finished == {"a", "b"}, f"stuck: running={len(s.running)} unfinished={s.num_unfinished} " \
                                   f"free={s.kv_manager.pool.num_free_blocks}"
    assert s.num_preemptions == 0, "a landed request was recomputed although the pool could serve both in turn"
    assert s.kv_manager.pool.num_free_blocks == s.kv_manager.pool.num_blocks
    s.check_integrity()


def test_landed_requests_take_blocks_below_the_watermark_while_others_run():
    """The same rule while a local prompt runs: the watermark keeps room for running decodes, and
    a landed request is one (it holds its prompt's blocks), so it does not wait for the prompt."""
    s = make(num_blocks=8, block_size=4, budget=16, watermark=0.125)  # a watermark of 1 block
    s.add_request(req("x", 4, max_tokens=20, first=200))
    run_step(s)  # x: 1 block, decoding for a long time
    assert s.reserve_remote(req("b", 12)) is not None  # 3 blocks
    s.finish_remote("b", 7)  # b needs a 4th block
    assert s.reserve_remote(req("a", 8, first=50)) is not None  # 2 blocks
    assert s.kv_manager.pool.num_free_blocks == 2
    out = run_step(s)  # x takes its 2nd block; b takes the last one, below the watermark
    assert [x.request_id for x in out.scheduled] == ["x", "b"], f"b waits for x: {out}"
    assert s.kv_manager.pool.num_free_blocks == 0 and not out.preempted_request_ids
    s.check_integrity()


def test_a_landed_request_that_cannot_grow_is_recomputed_instead_of_waiting_forever():
    s = make(num_blocks=8, block_size=4, watermark=0.0)
    s.reserve_remote(req("b", 16))  # the first reservation is allowed over the budget
    s.finish_remote("b", 7)  # b needs a 5th block
    assert s.reserve_remote(req("a", 16, first=50)) is not None  # the last 4 blocks
    assert s.kv_manager.pool.num_free_blocks == 0
    out = s.schedule()
    assert out.preempted_request_ids == ["b"] and s.requests["b"].status == RequestStatus.PREEMPTED
    s.check_integrity()
    s.finish_remote("a", 7)
    for _ in range(60):
        run_step(s)
        s.check_integrity()
        if not s.requests:
            break
    assert not s.requests and s.kv_manager.pool.num_free_blocks == 8


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
    assert s.kv_manager.holds("a")  # ... only once no more bytes can land, so not here
    s.abort("a")
    s.check_integrity()
    assert s.finish_remote("b", 7) is not None


def test_a_long_reservation_is_not_starved_by_short_ones():
    """Short reservations keep coming as room frees; the long one refused first gets the room."""
    s = make(num_blocks=16, block_size=4, watermark=0.0, remote_kv_budget=0.5)  # 8 blocks of budget
    assert s.reserve_remote(req("a", 8), now=0.0) is not None  # 2 blocks
    assert s.reserve_remote(req("b", 8, first=40), now=0.0) is not None  # 4
    assert s.reserve_remote(req("long", 24, first=80), now=0.0) is None  # 6 more: over the budget
    assert s.remote_claim.request_id == "long" and s.remote_claim.num_blocks == 6
    assert s.reserve_remote(req("c", 8, first=120), now=1.0) is None  # fits the budget, but is the long one's
    s.finish_remote("a", 7)  # 2 blocks of budget free again: before, "c" would take them
    assert s.reserve_remote(req("c", 8, first=120), now=2.0) is None
    assert s.remote_claim.request_id == "long"  # the oldest keeps the claim
    assert s.reserve_remote(req("long", 24, first=80), now=2.5) is not None  # the gateway's retry: 2 + 6 = 8
    assert s.remote_claim is None
    s.check_integrity()


def test_small_reservations_that_leave_the_claimant_its_room_go_ahead():
    s = make(num_blocks=16, block_size=4, budget=64, watermark=0.0, remote_kv_budget=1.0)
    for i in range(3):
        s.add_request(req(f"run{i}", 16, first=20 * i))  # 12 blocks held by running requests
    run_step(s), run_step(s)
    assert s.kv_manager.pool.num_free_blocks == 16 - 15  # each has its 5th block
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
    """15 blocks on a 16-block pool with an 8-block budget: allowed only alone; the claim makes the
    other reservations drain instead of always keeping one held, and with nothing else holding
    blocks the watermark (2 blocks) is not kept, or 15 + 2 > 16 would refuse it forever."""
    s = make(num_blocks=16, block_size=4, watermark=0.125, remote_kv_budget=0.5)
    assert s.reserve_remote(req("a", 8), now=0.0) is not None
    assert s.reserve_remote(req("long", 60, first=80), now=0.0) is None  # 15 blocks, not alone
    assert s.reserve_remote(req("b", 4, first=120), now=0.5) is None  # even one block would block it
    s.finish_remote("a", 7)
    while "a" in s.requests:
        run_step(s)
    # Nothing else holds blocks: the whole pool is there (no watermark), 15 of 16 blocks.
    assert s.reserve_remote(req("long", 60, first=80), now=1.0) is not None
    s.check_integrity()


def test_integrity_check_finds_an_unowned_reference():
    s = make()
    s.add_request(req("a", 6))
    run_step(s)
    s.check_integrity()
    s.kv_manager.pool.touch([s.kv_manager.req_to_blocks["a"][0]])  # a reference nobody owns
    with pytest.raises(AssertionError, match="owners"):
        s.check_integrity()
