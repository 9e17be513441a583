"""The batch gate of speculation (``speculative.step_cost``): with measured step rates given, it
speculates while verifying yields at least the plain rate of tokens per second at that batch size,
pauses (doubling) while it yields less, measures the plain rate first and again now and then, and
keeps batch sizes apart.  Fed through ``Speculation.observe_step`` as the engine feeds it."""
from types import SimpleNamespace

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
