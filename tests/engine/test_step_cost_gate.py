"""The batch gate of speculation (``speculative.step_cost``): with measured step rates given, it
speculates while verifying yields at least the plain rate of tokens per second at that batch size,
pauses (doubling) while it yields less, measures the plain rate first and again now and then, and
keeps batch sizes apart, while a budget for losing tries is shared by them all.  Fed through
``Speculation.observe_step`` as the engine feeds it."""
from types import SimpleNamespace

import pytest

from common.engine.speculative import step_cost
from common.engine.speculative.speculation import Speculation, SpeculativeConfig
from common.engine.speculative.step_cost import StepCostGate, batch_bucket


def run_steps(gate, num_decoding, steps, verify_rate, plain_rate):
    """``steps`` steps at ``num_decoding``; returns how many speculated."""
    speculated = 0
    for _ in range(steps):
        allowed = gate.allows(num_decoding)
        speculated += allowed
        gate.observe(num_decoding, allowed, 10, 10 / (verify_rate if allowed else plain_rate))
    return speculated


def test_speculates_while_it_pays():
    gate = StepCostGate()
    speculated = run_steps(gate, 1, 400, verify_rate=300.0, plain_rate=100.0)
    # Only the plain-rate probes (3 steps at the start, then every _REFRESH verifying steps) go plain.
    assert speculated >= 400 - step_cost._PROBE * (1 + 400 // step_cost._REFRESH)


def test_pauses_and_backs_off_while_it_does_not():
    gate = StepCostGate()
    speculated = run_steps(gate, 8, 2000, verify_rate=80.0, plain_rate=100.0)
    # Each try measures a few verifying steps, then the pauses double up to _MAX_PAUSE.
    assert speculated <= 0.05 * 2000
    assert gate._buckets[batch_bucket(8)].next_pause == step_cost._MAX_PAUSE


def test_batch_sizes_are_judged_apart():
    gate = StepCostGate()
    run_steps(gate, 16, 300, verify_rate=80.0, plain_rate=100.0)
    assert run_steps(gate, 1, 50, verify_rate=300.0, plain_rate=100.0) >= 50 - step_cost._PROBE
    assert batch_bucket(1) != batch_bucket(16) and batch_bucket(5) == batch_bucket(8)


def test_speculation_times_only_decode_steps_and_counts_pauses():
    speculation = Speculation(SpeculativeConfig("ngram"), 1024)
    item = lambda drafts, prompt_chunk=0: SimpleNamespace(  # noqa: E731
        sample=True, draft_token_ids=[7] * drafts, token_ids=[1] * (1 + drafts + prompt_chunk))
    speculation.observe_step([item(0, prompt_chunk=30)], 0.5, 1)  # a prompt chunk: not timed
    for _ in range(3):
        speculation.observe_step([item(3), item(0)], 0.2, 2)  # verified, but only the model's own tokens kept
    for _ in range(step_cost._PROBE):
        speculation.begin_step(2)
        speculation.observe_step([item(0), item(0)], 0.1, 2)
    speculation.observe_step([item(3), item(0)], 0.2, 2)  # slower than plain: the gate pauses
    speculation.begin_step(2)
    stats = speculation.stats
    assert (stats.verify_steps, stats.decode_steps) == (4, 3)
    assert stats.batch_pauses == step_cost._PROBE + 1


def test_without_the_gate_steps_are_timed_but_never_paused():
    speculation = Speculation(SpeculativeConfig("ngram", cost_gate=False), 1024)
    item = lambda drafts: SimpleNamespace(sample=True, draft_token_ids=[7] * drafts,  # noqa: E731
                                          token_ids=[1] * (1 + drafts))
    for _ in range(50):  # verifying at a tenth of the plain rate
        speculation.begin_step(1)
        speculation.observe_step([item(0)], 0.1, 1)
        speculation.begin_step(1)
        speculation.observe_step([item(3)], 1.0, 1)
    assert speculation._batch_allows
    assert (speculation.stats.verify_steps, speculation.stats.decode_steps, speculation.stats.batch_pauses) == (50, 50, 0)


def test_after_a_relapse_one_verifying_step_judges_each_try():
    """The first judgment takes ``_MIN_SAMPLES`` verifying steps; once speculation was judged not to
    pay, each later try stops after its first step (a try costing several plain steps would
    otherwise cost ``_MIN_SAMPLES`` of them every time), and ``rates`` keeps the last judged rate."""
    gate = StepCostGate()
    assert gate.rates(8) is None
    tries, steps, previous = [], 0, False
    for _ in range(600):
        allowed = gate.allows(8)
        if allowed:
            steps += 1
        elif previous:
            tries.append(steps)
            steps = 0
        previous = allowed
        gate.observe(8, allowed, 10, 10 / (50.0 if allowed else 100.0))
    assert tries[0] == step_cost._MIN_SAMPLES and tries[1:] and set(tries[1:]) == {1}
    assert gate.rates(8) == (100.0, 50.0)


def test_a_costly_try_pauses_until_it_is_a_small_share_of_the_time():
    """A draft model's try -- its catch-up on the pause's tokens, then verifying at a fifth of the
    plain rate -- costs far more than a plain step: the pauses after it grow until each try has
    cost at most about ``_TRY_BUDGET`` of the plain time between tries, not doubling to a fixed cap."""
    gate, plain_rate, lost, plain_time, resumed = StepCostGate(), 100.0, 0.0, 0.0, True
    for _ in range(30_000):
        allowed = gate.allows(1)
        if allowed and resumed:
            gate.observe_catch_up(1, 1, 1.0)  # one token while the draft feeds the pause's tokens
            lost += 1.0 - 1 / plain_rate
        resumed = not allowed
        seconds = 1 / (plain_rate / 5 if allowed else plain_rate)
        gate.observe(1, allowed, 1, seconds)
        lost += seconds - 1 / plain_rate
        plain_time += 1 / plain_rate
    assert lost <= 2 * step_cost._TRY_BUDGET * plain_time + 1.2  # the first try's ~1.1 s aside


def test_when_verifying_stops_paying_the_pause_is_sized_by_every_step_that_lost():
    """Text that stops repeating itself: the verifying average, learned while it paid, takes a few
    losing steps to fall below the plain rate; the pause then counts all of them (not only the step
    that tipped the average), so one pause covers what they lost and no second try follows soon."""
    gate = StepCostGate()
    run_steps(gate, 1, 300, verify_rate=300.0, plain_rate=100.0)
    tries = 0
    previous = True
    for _ in range(2000):
        allowed = gate.allows(1)
        tries += allowed and not previous
        previous = allowed
        gate.observe(1, allowed, 1, 1 / (5.0 if allowed else 100.0))  # verifying at a twentieth of plain
    assert tries == 0


class _Proposer:
    """A draft model's side of the entry rule: ``entry_tokens`` each request still lacks."""

    needs_slots_first = True
    catching_up = False

    def __init__(self, seconds_per_fed_token):
        self.seconds_per_fed_token = seconds_per_fed_token
        self.lacking: dict[str, int] = {}

    def entry_tokens(self, request):
        return self.lacking.get(request.request_id, 1)

    def propose_batch(self, wants):
        return [[7] * wanted for _, wanted, *_ in wants]

    def forget(self, request_id):
        self.lacking.pop(request_id, None)


def _request(request_id, output_tokens=1, max_tokens=100):
    return SimpleNamespace(request_id=request_id, num_output_tokens=output_tokens,
                           num_tokens=50 + output_tokens, grammar=None, hold_blocks_on_finish=False,
                           sampling_params=SimpleNamespace(max_tokens=max_tokens, uses_penalties=False))


_SLOTS = SimpleNamespace(allocate_slots=lambda request, n, reserve_blocks=0: True, block_ids=lambda request_id: [0])


def _speculation(plain=None, verifying=None, seconds_per_fed_token=0.01):
    speculation = Speculation(SpeculativeConfig("draft", draft_model="d", num_tokens=4), 4096,
                              _Proposer(seconds_per_fed_token))
    if plain is not None:  # the batch of 8's rates, measured
        bucket = speculation.gate._bucket(8)
        for _ in range(step_cost._MIN_SAMPLES):
            bucket.plain.add(plain)
            bucket.verifying.add(verifying)
    speculation.begin_step(8)
    return speculation


def test_a_draft_models_catch_up_enters_only_where_the_remaining_tokens_repay_it():
    # Verifying at 2x: each remaining token saves half of a plain step's share (8 / 100 s): 0.04 s.
    speculation = _speculation(plain=100.0, verifying=200.0, seconds_per_fed_token=0.01)
    speculation.proposer.lacking = {"long": 200, "short": 200, "steady": 1}
    assert speculation.draft(_request("long", max_tokens=100), 64, _SLOTS)  # 0.04 x 100 > 0.01 x 200
    assert not speculation.draft(_request("short", max_tokens=40), 64, _SLOTS)  # 0.04 x 40 < 2 s
    assert speculation.draft(_request("steady", max_tokens=3), 64, _SLOTS)  # nothing to catch up on


@pytest.mark.parametrize("rates", [None, (100.0, 80.0)], ids=["unmeasured", "not-paying"])
def test_until_verifying_is_measured_to_pay_one_request_at_a_time_enters(rates):
    speculation = _speculation(*(rates or ()))
    speculation.proposer.lacking = {"a": 200, "b": 200}
    assert speculation.draft(_request("a"), 64, _SLOTS)
    assert not speculation.draft(_request("b"), 64, _SLOTS)  # "a" is on trial
    speculation.forget("a")
    assert speculation.draft(_request("b"), 64, _SLOTS)


def test_a_catch_up_step_is_counted_but_not_judged():
    speculation = Speculation(SpeculativeConfig("draft", draft_model="d"), 1024, _Proposer(0.01))
    item = lambda drafts: SimpleNamespace(sample=True, draft_token_ids=[7] * drafts,  # noqa: E731
                                          token_ids=[1] * (1 + drafts))
    speculation.proposer.catching_up = True
    for _ in range(5):
        speculation.observe_step([item(3)], 5.0, 1)  # a prompt fed to the draft: a slow step
    assert speculation.stats.verify_steps == 5 and speculation.gate.rates(1) is None
    assert not speculation.gate._bucket(1).verifying.samples
    assert speculation.gate._bucket(1).try_seconds == 25.0  # but what the try cost
    speculation.proposer.catching_up = False
    speculation.observe_step([item(3)], 0.1, 4)
    assert speculation.gate._bucket(1).verifying.samples == 1


def test_a_losing_try_at_one_batch_size_holds_back_the_first_try_at_another():
    """The budget for tries is shared: verifying that lost at 8 requests leaves nothing for a first
    try at 4 (the tail of a burst) until plain steps have earned back what was lost."""
    gate = StepCostGate()
    while gate.allows(8):  # verifying at half the plain rate, until judged
        gate.observe(8, True, 8, 8 / 50.0)
    gate.observe(8, False, 8, 8 / 100.0)
    while not gate.allows(8):  # the rest of the plain rate's probe
        gate.observe(8, False, 8, 8 / 100.0)
    while gate.allows(8):
        gate.observe(8, True, 8, 8 / 50.0)
    assert gate.credit < 0
    plain_steps = 0
    while not gate.allows(4):
        gate.observe(4, False, 4, 4 / 100.0)
        plain_steps += 1
    assert gate.credit >= 0 and plain_steps > 10 * step_cost._PROBE


def test_verifying_before_the_plain_rate_is_known_is_charged_once_it_is():
    gate = StepCostGate()
    for _ in range(step_cost._MIN_SAMPLES):
        gate.observe(1, True, 1, 1.0)  # a token a second, the plain rate not yet known
    assert gate.credit == 0.0
    for _ in range(step_cost._PROBE):
        gate.observe(1, False, 1, 0.1)  # ten a second
    lost = step_cost._MIN_SAMPLES * (1.0 - 0.1)
    assert gate.credit == pytest.approx(step_cost._PROBE * step_cost._TRY_BUDGET * 0.1 - lost)


def test_no_catch_up_enters_while_the_budget_for_tries_is_spent():
    """Rates that say verifying pays (learnt on text that repeats itself) do not let requests in to
    catch up while recent verifications lost more than plain steps earned."""
    speculation = _speculation(plain=100.0, verifying=200.0, seconds_per_fed_token=0.01)
    speculation.proposer.lacking = {"long": 200, "steady": 1}
    speculation.gate.credit = -0.5
    assert not speculation.draft(_request("long", max_tokens=100), 64, _SLOTS)
    assert speculation.draft(_request("steady", max_tokens=3), 64, _SLOTS)  # in step: nothing to catch up on
    speculation.gate.credit = 0.0
    assert speculation.draft(_request("long", max_tokens=100), 64, _SLOTS)


def test_plain_steps_whose_outputs_were_all_dropped_price_nothing():
    """Plain steps that produced no tokens (every output dropped: aborts) give a plain rate of 0:
    verifying steps are then held unpriced, not divided by it."""
    gate = StepCostGate()
    for _ in range(step_cost._PROBE):
        gate.observe(1, False, 0, 0.1)
    for _ in range(step_cost._MIN_SAMPLES):
        gate.observe(1, True, 1, 1.0)
    gate.allows(1)
    assert gate.credit >= 0.0
