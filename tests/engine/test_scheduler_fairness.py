"""Local prompts against a steady stream of reservations for remote KV: first come, first served.

Reservations are decided between steps (the decode worker's commands), and landed requests are
admitted before waiting ones; so a waiting prompt is protected only if a reservation that would
keep it waiting is refused.  Three ways it was not (review of issue 27's fix):

* the prompt's claim was taken only inside ``schedule()``, which the engine thread does not call
  while ``has_work()`` is false: with nothing running, reservations that ended unlanded were
  replaced by new ones freely, and the prompt waited for as long as they kept coming;
* a prompt that fits alone but finds no free blocks for its chunk was not protected at all;
* the claim ended at the first token, so a long request was preempted (and recomputed) each time
  new reservations took the room it was to grow into.

These tests drive the scheduler as the engine thread does: a step only when ``has_work()``.
"""
from common.engine.kv.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=8, watermark=0.0, remote_kv_budget=0.5, max_seqs=8, caching=True):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                             watermark=watermark, remote_kv_budget=remote_kv_budget, remote_claim_s=0.5)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks, enable_caching=caching), block_size))


def req(rid, n_prompt, max_tokens=4, first=10):
    return Request(rid, [first + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler, computed: dict[str, int] | None = None):
    """One engine-thread iteration: a step only if ``has_work()``; ``computed`` counts the tokens
    computed per request."""
    if not s.has_work():
        return None
    out = s.schedule()
    for item in out.scheduled:
        if computed is not None:
            computed[item.request_id] = computed.get(item.request_id, 0) + len(item.token_ids)
    s.update(out, {x.request_id: 5 for x in out.scheduled if x.sample})
    s.check_integrity()
    return out


def test_reservations_that_end_unlanded_are_not_replaced_while_a_prompt_waits_for_their_room():
    """Nothing runs, so the engine thread takes no step; a 20-token prompt cannot fit beside a
    16-token reservation.  When that reservation ends without its KV (its lease ran out), a new one
    must not take the room: before, each such round was granted (49 of 49 in the review)."""
    s = make(num_blocks=8, budget=3, watermark=0.125)
    assert s.reserve_remote(req("r0", 16, first=100), now=0.0) is not None  # 4 of 8 blocks
    s.add_request(req("long", 20))  # 5 blocks: only 4 are left beside the reservation
    assert step(s) is None  # has_work() is false: no step, as in the engine thread
    granted = 0
    for n in range(1, 50):
        s.abort(f"r{n - 1}")  # it ended unlanded (only if it was granted)
        if s.reserve_remote(req(f"r{n}", 16, first=100 + 20 * n), now=float(n)) is not None:
            granted += 1
        if s.requests["long"].num_output_tokens:
            break
        step(s)
    assert s.requests["long"].num_output_tokens or "long" not in s.requests, (
        f"the prompt never ran: {granted} reservations took its room")
    assert granted == 0, f"{granted} reservations were granted while the prompt waited for their room"


def test_a_prompt_that_fits_alone_is_not_starved_of_free_blocks_by_reservations():
    """The review's case: 16 blocks of 4 tokens, a budget of 8, two 4-token reservations offered
    before every step (each lands at once), a 40-token local prompt from step 20 on.  Before, it
    was still waiting after 3,000 steps while 3,008 remote requests were served."""
    s = make(num_blocks=16, budget=8, watermark=0.0, remote_kv_budget=0.5)
    served = 0
    ids = iter(range(10**6))
    for n in range(400):
        if n == 20:
            s.add_request(req("local", 40, max_tokens=4))
        for _ in range(2):
            rid = f"r{next(ids)}"
            if s.reserve_remote(req(rid, 4, max_tokens=4, first=1000 + 4 * (n % 50)), now=float(n)) is not None:
                s.finish_remote(rid, 5)
                served += 1
        step(s)
        if n > 20 and ("local" not in s.requests or s.requests["local"].num_output_tokens):
            break
    assert "local" not in s.requests or s.requests["local"].num_output_tokens, (
        f"the local prompt never ran while {served} remote requests were served: {s.requests['local']}")


def test_a_long_request_keeps_the_room_to_finish_instead_of_being_recomputed():
    """A 12-token prompt with max_tokens=48 needs 15 of the 16 blocks by its end.  It first waits
    for a reservation of 14 blocks (so it holds the local claim); then a reservation of 2 blocks,
    its KV landing 3 steps later, is offered before every step.  Before, the claim ended at the
    prompt's first token, new reservations took the room it was growing into, and it was
    preempted and recomputed again and again (207 tokens computed for 59 in the review)."""
    for caching in (True, False):
        s = make(num_blocks=16, budget=8, watermark=0.0, remote_kv_budget=0.5, caching=caching)
        assert s.reserve_remote(req("r0", 56, max_tokens=2, first=500), now=0.0) is not None  # alone: over the budget
        s.add_request(req("long", 12, max_tokens=48))  # 3 blocks: 2 are left
        computed: dict[str, int] = {}
        due: dict[str, int] = {"r0": 2}  # reservation -> the step its KV lands
        for n in range(1, 2000):
            if "long" not in s.requests:
                break
            rid = f"r{n}"
            if s.reserve_remote(req(rid, 8, max_tokens=2, first=1000 + 8 * (n % 50)), now=float(n)) is not None:
                due[rid] = n + 3
            for rid in [rid for rid, at in due.items() if at <= n]:
                s.finish_remote(rid, 5)
                del due[rid]
            step(s, computed)
        assert "long" not in s.requests, f"caching={caching}: never finished: {s.requests['long']}"
        # Its prompt and 47 of its outputs (the last token is sampled, never computed).
        assert computed["long"] == 12 + 47, f"caching={caching}: computed {computed['long']} tokens for 59"


class RightDrafts:
    """Drafts a step then accepts in full (a repetitive answer): speculation never backs off."""

    def propose(self, request, num_tokens, block_ids):
        return [7] * num_tokens

    def forget(self, request_id):
        pass


def test_drafts_take_only_what_the_running_requests_and_the_next_prompt_leave():
    """Two requests whose drafts always hold took every token of each step: the requests behind
    them got none and a prompt with a free seat was never admitted, while they lasted."""
    from common.engine.speculative.speculation import Speculation, SpeculativeConfig

    speculation = Speculation(SpeculativeConfig("ngram", num_tokens=3, cost_gate=False), 256)
    speculation.proposer = RightDrafts()
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256, watermark=0.0)
    s = Scheduler(config, KVCacheManager(BlockPool(64), 4), speculation)
    for i in range(3):
        s.add_request(req(f"r{i}", 2, max_tokens=200, first=10 * i))
    def accepted(out):  # every draft, and one token more
        return {x.request_id: [*x.draft_token_ids, 7] if x.draft_token_ids else 7 for x in out.scheduled if x.sample}

    for _ in range(3):  # their prompts
        s.update(out := s.schedule(), accepted(out))
    s.add_request(req("late", 5, max_tokens=200, first=100))
    gained = dict.fromkeys(["r0", "r1", "r2", "late"], 0)
    for _ in range(12):
        out = s.schedule()
        assert out.num_scheduled_tokens <= 8
        s.update(out, accepted(out))
        for x in out.scheduled:
            gained[x.request_id] += 1
    assert all(n == 12 for r, n in gained.items() if r != "late"), gained  # a token every step
    assert gained["late"] >= 11, gained  # admitted at once: its prompt, then a token a step
