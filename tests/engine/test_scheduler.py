"""The unified scheduler on tiny pools: token budget per step, ordering, preemption, prefix hits."""
import pytest

from common.engine.kv.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=32, block_size=4, budget=8, max_seqs=8, watermark=0.0, max_model_len=256):
    from common.engine.scheduler import Scheduler

    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=max_model_len, watermark=watermark)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size))


def req(rid, n_prompt, max_tokens=4, first_token=10, **params):
    tokens = list(range(first_token, first_token + n_prompt))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def step(sched, token=5):
    """One step with every sampling request producing ``token``."""
    out = sched.schedule()
    sched.update(out, {s.request_id: token for s in out.scheduled if s.sample})
    return {s.request_id: len(s.token_ids) for s in out.scheduled}, out


def test_budget_chunks_the_last_admitted_prompt():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 5))
    s.add_request(req("b", 6))
    counts, out = step(s)
    assert counts == {"a": 5, "b": 3}  # b chunked to fit the 8-token budget
    assert [x.sample for x in out.scheduled] == [True, False]
    counts, _ = step(s)
    assert counts == {"a": 1, "b": 3}  # a decodes first, then b's prefill continues
    counts, _ = step(s)
    assert counts == {"a": 1, "b": 1}


def test_decodes_take_budget_before_partial_prefills():
    s = make_scheduler(budget=4)
    s.add_request(req("long", 10))
    step(s)  # long: 4 of 10
    s.add_request(req("short", 2))
    step(s)  # long: 4 more (running first), short waits
    counts, _ = step(s)
    assert counts == {"long": 2, "short": 2}
    counts, _ = step(s)
    # Both now decode? long finished its prompt last step and sampled; short too.
    assert counts == {"long": 1, "short": 1}


def test_decode_before_partial_prefill_when_both_running():
    s = make_scheduler(budget=4)
    s.add_request(req("p", 12))
    s.add_request(req("d", 2))
    step(s)  # p: 4 (admitted first), d waits for budget
    counts, out = step(s)  # p continues (running) with all 4
    assert counts == {"p": 4}
    s2 = make_scheduler(budget=5)
    s2.add_request(req("d", 2))
    s2.add_request(req("p", 12))
    step(s2)  # d: 2 (samples), p: 3
    counts, out = step(s2)
    assert [x.request_id for x in out.scheduled] == ["d", "p"] and counts == {"d": 1, "p": 4}


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(budget=64, max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3))
    counts, _ = step(s)
    assert counts == {"a": 3, "b": 3}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_stop_token_max_tokens_and_context_length():
    s = make_scheduler(budget=64)
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("ign", 3, max_tokens=2, ignore_eos=True))
    out = s.schedule()
    changed = s.update(out, {"eos": EOS, "len": 7, "ign": EOS})
    status = {r.request_id: r.status for r in changed}
    assert status["eos"] == RequestStatus.FINISHED_STOPPED
    assert status["len"] == RequestStatus.RUNNING and status["ign"] == RequestStatus.RUNNING
    out = s.schedule()
    changed = s.update(out, {"len": 7, "ign": EOS})
    assert {r.request_id: r.status for r in changed} == {
        "len": RequestStatus.FINISHED_LENGTH, "ign": RequestStatus.FINISHED_LENGTH}
    assert s.kv_manager.pool.num_free_blocks == s.kv_manager.pool.num_blocks

    short = make_scheduler(budget=64, max_model_len=6)
    short.add_request(req("ctx", 4, max_tokens=100))
    step(short)
    step(short)
    assert short.requests == {}  # 4 prompt + 2 output = the context length


def test_preempts_newest_and_recomputes_later():
    s = make_scheduler(num_blocks=4, block_size=2, budget=16)
    s.add_request(req("old", 4, max_tokens=4))
    s.add_request(req("new", 4, max_tokens=4, first_token=50))
    step(s)  # each holds 2 blocks: the pool is full
    counts, out = step(s)  # old needs a third block for token 4 -> new is preempted
    assert out.preempted_request_ids == ["new"]
    assert counts == {"old": 1}
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting[0] is new and new.num_output_tokens == 1
    s.kv_manager.pool.check_integrity()
    # Once old finishes, new is recomputed from scratch, including its first output token.
    while "old" in s.requests:
        step(s)
    counts, _ = step(s)
    assert counts == {"new": 5}  # 4 prompt tokens + 1 output token recomputed


def test_watermark_holds_back_new_prompts_but_not_decodes():
    s = make_scheduler(num_blocks=10, block_size=2, budget=64, watermark=0.3)  # keep 3 blocks free
    s.add_request(req("a", 8, max_tokens=8))  # 4 blocks, leaves 6
    s.add_request(req("b", 6, max_tokens=8))  # 3 more would leave 3: allowed
    s.add_request(req("c", 2, max_tokens=8))  # 1 more would leave 2 < 3: held back
    counts, _ = step(s)
    assert counts == {"a": 8, "b": 6}
    assert [r.request_id for r in s.waiting] == ["c"]
    counts, _ = step(s)  # decodes may dip into the watermark
    assert counts == {"a": 1, "b": 1}


def test_prefix_hit_skips_computed_tokens():
    s = make_scheduler(budget=64, block_size=4)
    s.add_request(req("a", 13))
    step(s)
    s.add_request(req("b", 13))  # the same 13-token prompt
    counts, out = step(s)
    assert counts["b"] == 1  # 3 full blocks = 12 tokens hit; only the last token computed
    assert s.requests["b"].num_cached_tokens == 12
    assert out.scheduled[-1].num_computed_tokens == 12


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    s = make_scheduler(budget=4)
    s.add_request(req("run", 10))
    s.add_request(req("wait", 10))
    step(s)
    assert s.kv_manager.pool.num_free_blocks < s.kv_manager.pool.num_blocks
    assert s.abort("run").status == RequestStatus.FINISHED_ABORTED
    assert s.abort("wait").status == RequestStatus.FINISHED_ABORTED
    assert s.abort("missing") is None
    assert s.kv_manager.pool.num_free_blocks == s.kv_manager.pool.num_blocks and not s.running and not s.waiting
    s.kv_manager.pool.check_integrity()


def test_remote_kv_reservation_then_decode():
    s = make_scheduler(num_blocks=8, block_size=4, budget=16)
    r = req("d", 9, max_tokens=3)
    block_ids, cached = s.reserve_remote(r)
    assert block_ids == [0, 1, 2] and cached == 0
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.schedule().is_empty  # nothing to compute until the KV lands
    s.finish_remote("d", 42)
    assert r.output_token_ids == [42] and r.num_computed_tokens == 9
    counts, out = step(s)
    assert counts == {"d": 1} and out.scheduled[0].token_ids == [42]
    # A second reservation for the same prefix reuses the committed blocks.
    r2 = req("e", 9, max_tokens=3)
    block_ids2, cached2 = s.reserve_remote(r2)
    assert cached2 == 8 and block_ids2[:2] == [0, 1]


def test_remote_kv_first_token_can_finish_the_request():
    s = make_scheduler()
    r = req("d", 5, max_tokens=1)
    s.reserve_remote(r)
    s.finish_remote("d", 7)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert s.kv_manager.pool.num_free_blocks == s.kv_manager.pool.num_blocks


def test_rejects_requests_that_can_never_run():
    s = make_scheduler(num_blocks=4, block_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("e", 0))
    with pytest.raises(ValueError, match="context length"):
        s.add_request(req("long", 64))
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(req("big", 6, max_tokens=5))  # 11 tokens > 8 slots
    s.add_request(req("ok", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("ok", 3))
