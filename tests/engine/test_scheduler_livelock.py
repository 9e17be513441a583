"""A prompt that cannot fit in the blocks left outside reservations, landed requests and pins.

Before the fix, such a prompt was admitted a chunk at a time, preempted itself when the pool ran
out and was admitted again from its cached blocks, forever: no step was ever empty, so the engine
thread never slept, and first-come-first-served kept every prompt behind it waiting, even ones
that fit.  Now it waits (without being admitted) until it fits alone, others overtake it, the
reservations it waits for cannot be replaced by new ones, and a step with nothing to do is empty.
"""
import pytest

from common.engine.kv.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler


def make(num_blocks=8, block_size=4, budget=3, watermark=0.125, remote_kv_budget=0.5, caching=True, max_seqs=4,
         claim_s=3.0):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                             watermark=watermark, remote_kv_budget=remote_kv_budget, remote_claim_s=claim_s)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks, enable_caching=caching), block_size))


def req(rid, n_prompt, max_tokens=4, first=10):
    return Request(rid, [first + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s, token=5):
    out = s.schedule()
    s.update(out, {x.request_id: token for x in out.scheduled if x.sample})
    s.check_integrity()
    return out


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_a_prompt_that_cannot_fit_beside_a_reservation_neither_spins_nor_blocks_the_queue(caching):
    """The reproduction of issue 27: 8 blocks, a 16-token reservation holds 4 of them; a 20-token
    prompt needs 5.  Before: 10,000 steps, ~5,000 self-preemptions, the 4-token prompt never ran."""
    s = make(caching=caching)
    assert s.reserve_remote(req("remote", 16, first=100)) is not None  # 4 blocks
    s.add_request(req("long", 20))  # 5 blocks: only 4 can ever be its while the reservation holds
    s.add_request(req("short", 4, first=50))
    short_done_at = None
    for n in range(200):
        run_step(s)
        if "short" not in s.requests:
            short_done_at = n
            break
    assert short_done_at is not None, (
        f"the short prompt never ran: long preempted {s.requests['long'].num_preemptions} times, "
        f"running={[r.request_id for r in s.running]}")
    assert s.requests["long"].num_preemptions == 0, "admitted although it could not fit, then preempted"
    # Nothing can run now: the step is empty (the engine thread sleeps on that) and says so.
    out = s.schedule()
    assert out.is_empty and not out.preempted_request_ids
    assert not s.has_work()
    # The reservation lands and runs; then the long prompt fits and finishes.
    s.finish_remote("remote", 7)
    assert s.has_work()
    for _ in range(200):
        if not s.requests:
            break
        run_step(s)
    assert not s.requests, f"never finished: {list(s.requests.values())}"
    assert s.kv_manager.pool.num_free_blocks == s.kv_manager.pool.num_blocks


def test_a_running_request_that_cannot_grow_even_alone_preempts_only_itself():
    """Preempting a newer request whose blocks a reservation shares (through the prefix cache)
    frees nothing: before, the old request took it down anyway, then itself."""
    s = make(num_blocks=16, block_size=4, budget=16, watermark=0.0, remote_kv_budget=0.5)
    s.add_request(req("long", 31, max_tokens=20))
    s.add_request(req("x", 8, max_tokens=30, first=100))
    run_step(s), run_step(s), run_step(s)  # long: 8 blocks, decoding; x: 2 full blocks, decoding
    assert [r.request_id for r in s.running] == ["long", "x"] and s.kv_manager.pool.num_free_blocks == 6
    shares_x = Request("q", [100 + i for i in range(8)] + [7, 7, 7, 7], SamplingParams(max_tokens=2))
    assert s.reserve_remote(shares_x)[1] == 8  # x's 2 blocks (cached) + 1 new
    assert s.reserve_remote(req("q2", 20, first=200)) is not None  # 5 blocks: none free now
    # long needs a 9th block: 16 blocks minus the 8 the reservations hold leave it 8.
    out = run_step(s)
    assert out.preempted_request_ids == ["long"], "only the request that cannot grow had to go"
    assert [x.request_id for x in out.scheduled] == ["x"]
    # It is not admitted again while it cannot fit: x decodes alone, nothing is preempted.
    for _ in range(5):
        out = run_step(s)
        assert [x.request_id for x in out.scheduled] == ["x"] and not out.preempted_request_ids
    assert s.requests["long"].num_preemptions == 1


def test_new_reservations_cannot_starve_a_prompt_that_waits_for_room():
    """Reservations keep arriving, each landing three steps later: before, as many blocks were
    always reserved as kept the waiting prompt out.  Now one that would leave it no room to run
    alone is refused (busy) until it has produced its first token.  (Refused reservations never
    come back here, so their own claims end at once and do not hold the others back.)"""
    s = make(num_blocks=16, block_size=4, budget=8, watermark=0.0, remote_kv_budget=0.5, claim_s=0.5)
    now = 0.0
    in_flight = {"r0": 3}  # reservation -> the step its KV lands
    assert s.reserve_remote(req("r0", 24, max_tokens=2, first=100), now=now) is not None  # 6 blocks
    s.add_request(req("long", 48, max_tokens=2))  # 12 blocks: 10 are left beside r0
    refused = 0
    for n in range(1, 80):
        if s.requests["long"].num_output_tokens:
            break
        now += 1.0
        if s.reserve_remote(req(f"r{n}", 8, max_tokens=2, first=100 + 10 * n), now=now) is None:
            refused += 1  # a 2-block reservation: within the budget, and there is room
        else:
            in_flight[f"r{n}"] = n + 3
        for rid in [rid for rid, due in in_flight.items() if due <= n]:
            s.finish_remote(rid, 7)
            del in_flight[rid]
        run_step(s)
    assert s.requests["long"].num_output_tokens, "the waiting prompt never ran"
    assert refused, "no reservation was refused for it"
    assert s.local_claim is s.requests["long"]  # its claim lasts until it ends


def test_has_work_says_whether_a_step_could_compute_anything():
    s = make(num_blocks=8, block_size=4, budget=3)
    assert not s.has_work()
    assert s.reserve_remote(req("remote", 16, first=100)) is not None
    assert not s.has_work()  # waiting for remote KV is not work
    s.add_request(req("long", 20))  # cannot fit beside the reservation
    assert not s.has_work()
    assert s.schedule().is_empty
    s.abort("remote")
    assert s.has_work()
    run_step(s)
    assert [r.request_id for r in s.running] == ["long"]


def test_prefill_prompts_do_not_overtake_a_prompt_that_waits_for_their_pins():
    """Prefill role: a prompt waits for the blocks on the wire.  Prompts that would hold their own
    blocks once finished (shipping) do not go ahead of it, or it could wait forever; others may."""
    s = make(num_blocks=8, block_size=4, budget=8, watermark=0.0)
    shipped = req("p", 12, max_tokens=1)
    shipped.hold_blocks_on_finish = True
    s.add_request(shipped)
    run_step(s), run_step(s)
    pins = list(s.kv_manager.req_to_blocks["p"])  # 3 blocks on the wire, as the shipper pins them
    s.kv_manager.pin(pins)
    s.release_held("p")
    for rid, n_prompt, first, hold in (("big", 24, 100, True), ("held", 4, 150, True), ("free", 4, 200, False)):
        request = req(rid, n_prompt, max_tokens=1, first=first)
        request.hold_blocks_on_finish = hold
        s.add_request(request)  # big needs 6 blocks: 5 are left beside the pins
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["free"], f"scheduled {out.scheduled}"
    assert s.local_claim is s.requests["big"]
    s.kv_manager.unpin(pins)  # sent
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["big"]


def test_a_landed_request_that_cannot_run_alone_is_recomputed_or_has_the_newest_recomputed():
    """Blocked by another landed request only: the newest landed request is recomputed (as before).
    Blocked even without the other landed ones -- here the newer one's blocks are shared with a
    reservation, so recomputing it would free nothing: the head itself goes, and the newer one runs
    (before, both were recomputed, the newer one for nothing)."""
    s = make(num_blocks=8, block_size=4, budget=8, watermark=0.0, remote_kv_budget=0.5)
    assert s.reserve_remote(req("old", 12)) is not None  # 3 blocks
    s.finish_remote("old", 7)  # needs a 4th
    assert s.reserve_remote(req("new", 20, first=100)) is not None  # 5 blocks (alone: over the budget)
    s.finish_remote("new", 7)  # needs a 6th; nothing is free
    out = run_step(s)
    assert out.preempted_request_ids == ["new"] and [x.request_id for x in out.scheduled] == ["old"]

    s = make(num_blocks=16, block_size=4, budget=8, watermark=0.0, remote_kv_budget=0.5)
    assert s.reserve_remote(req("head", 36)) is not None  # 9 blocks (alone: over the budget)
    s.finish_remote("head", 7)  # needs a 10th
    assert s.reserve_remote(req("newer", 8, first=100)) is not None  # 2 blocks
    s.finish_remote("newer", 7)  # needs a 3rd; its 2 full blocks are in the prefix cache now
    sharing = Request("r", [100 + i for i in range(8)] + [7] * 20, SamplingParams(max_tokens=2))
    assert s.reserve_remote(sharing)[1] == 8  # 7 blocks, 2 of them newer's: nothing is free
    out = run_step(s)
    assert out.preempted_request_ids == ["head"] and [x.request_id for x in out.scheduled] == ["newer"]
