"""Speculative drafts take only what a step leaves: never the blocks another running request needs
for its own next token (a review found a request's drafts taking the last free block, so that the
request behind it -- or the drafting one -- was preempted and recomputed, where without drafts both
decoded side by side).  ``Speculation.draft`` says so: "no room for the drafts' slots: decode plainly
rather than preempt anyone"."""
import copy

from hypothesis import HealthCheck, given, settings, strategies as st

from common.engine.config import SchedulerConfig
from common.engine.kv.block_pool import BlockPool
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.speculative.speculation import Speculation, SpeculativeConfig


class FixedDrafts:
    """Proposes ``n`` copies of token 7 (what the verification makes of them is the test's)."""

    def propose(self, request, n, block_ids):
        return [7] * n

    def forget(self, request_id):
        pass


def make(num_blocks: int, block_size: int = 4, drafts: int = 3) -> Scheduler:
    speculation = Speculation(SpeculativeConfig("ngram", num_tokens=drafts, cost_gate=False), 256)
    speculation.proposer = FixedDrafts()
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, watermark=0.0)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size), speculation)


def req(request_id: str, num_prompt: int, first: int, max_tokens: int = 8) -> Request:
    return Request(request_id, list(range(first, first + num_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler, accepted=lambda item: 0):
    out = s.schedule()
    s.update(out, {x.request_id: list(x.draft_token_ids[: accepted(x)]) + [9] if x.draft_token_ids else 9
                   for x in out.scheduled if x.sample})
    s.check_integrity()
    return out


def test_drafts_leave_the_block_the_request_behind_needs_for_its_next_token():
    """Three blocks of four tokens: a (3 tokens) and b (5) decode side by side, one block free --
    which b needs for its next token, and a's drafts would have taken."""
    s = make(num_blocks=3)
    s.add_request(req("a", 2, first=10))
    s.add_request(req("b", 4, first=20))
    step(s)
    assert s.kv_manager.pool.num_free_blocks == 1
    out = step(s)
    assert out.preempted_request_ids == [], "drafts cost another request its place"
    assert {x.request_id for x in out.scheduled} == {"a", "b"}
    assert s.num_preemptions == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(7, 16), prompts=st.lists(st.integers(1, 14), min_size=1, max_size=4),
       drafts=st.integers(1, 4), acceptance=st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_a_step_preempts_no_one_that_the_same_step_without_drafts_would_not(num_blocks, prompts, drafts, acceptance):
    """From whatever state the steps before led to, the step with drafts preempts only where the
    same step without them would have had to."""
    s = make(num_blocks, drafts=drafts)
    for n, num_prompt in enumerate(prompts):
        s.add_request(req(f"r{n}", num_prompt, first=100 * n + 1, max_tokens=12))
    for index in range(60):
        if not s.has_work():
            break
        plain = copy.deepcopy(s)
        plain.speculation.proposer = None
        plain_out = plain.schedule()
        out = step(s, lambda item: acceptance[index % len(acceptance)])
        if not plain_out.preempted_request_ids:
            assert not out.preempted_request_ids, f"step {index}: drafts preempted {out.preempted_request_ids}"
