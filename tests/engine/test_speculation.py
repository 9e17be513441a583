"""The scheduler's side of speculation (``speculative.speculation``): a request's back-off starts from
what its predecessors' verifications accepted."""
from types import SimpleNamespace

from common.engine.speculative.speculation import Speculation, SpeculativeConfig


class FixedDrafts:
    def propose(self, request, num_tokens, block_ids):
        return [7] * num_tokens

    def forget(self, request_id):
        pass


class Slots:
    def allocate_slots(self, request, num_tokens, reserve_blocks=0):
        return []


def request(request_id: str):
    return SimpleNamespace(request_id=request_id, num_output_tokens=1, num_tokens=20, grammar=None,
                           hold_blocks_on_finish=False, all_token_ids=list(range(20)),
                           sampling_params=SimpleNamespace(max_tokens=1000, uses_penalties=False))


def verifications_until_backoff(speculation: Speculation, request_id: str, accepted: int) -> int:
    """Verify ``request_id``'s drafts, each keeping ``accepted``, until it backs off."""
    backoffs = speculation.stats.backoffs
    for count in range(1, 50):
        speculation.begin_step(1)
        drafts = speculation.draft(request(request_id), 100, Slots())
        assert drafts, "a request that has not backed off drafts"
        speculation.record(request_id, len(drafts), accepted, 20)
        if speculation.stats.backoffs > backoffs:
            return count
    raise AssertionError("never backed off")


def new_speculation() -> Speculation:
    speculation = Speculation(SpeculativeConfig("ngram", num_tokens=4, cost_gate=False), 4096)
    speculation.proposer = FixedDrafts()
    return speculation


def test_where_drafts_have_been_failing_a_new_request_backs_off_at_its_first_failure():
    speculation = new_speculation()
    first = verifications_until_backoff(speculation, "a", accepted=0)
    assert first == 4  # nothing known yet: the optimistic start
    for name in "bcd":
        speculation.forget(name)
        assert verifications_until_backoff(speculation, name, accepted=0) == 1


def test_where_drafts_have_been_paying_a_new_request_keeps_the_optimistic_start():
    speculation = new_speculation()
    for _ in range(30):  # a request whose drafts are all accepted
        speculation.begin_step(1)
        assert speculation.draft(request("good"), 100, Slots())
        speculation.record("good", 4, 4, 20)
    speculation.forget("good")
    assert verifications_until_backoff(speculation, "new", accepted=0) == 4  # not more: the start stays capped
