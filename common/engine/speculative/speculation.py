"""The scheduler's side of speculative decoding: draft tokens for the requests that may speculate
this step, their KV slots, and each request's acceptance (``SpeculativeConfig`` holds the knobs).

A decoding request is scheduled as ``[its last token, d1 .. dk]``: one step computes all k + 1
positions and the runner keeps the drafts the model agrees with plus one token of its own
(``verify``).  Rejected drafts leave KV in slots past ``num_computed_tokens``; those are written
over when the request gets that far, and blocks allocated for them stay in the request's table
(used by its next tokens, freed with it), so nothing leaks and no other request sees them.

Who speculates: decoding requests (at least one output token: a prompt's first token is never
guessed), not holding their blocks for shipping, without a grammar or penalties (their state would
have to advance through tokens that may be rejected), while the batch has at most
``disable_batch_size`` decoding requests (0: any size), while verifying pays at this batch size
(``step_cost``: measured tokens per second with and without drafts; ``cost_gate`` off skips the
measurement and always verifies), and not while backing off.  With a draft model, a request whose
draft KV lags (its prompt, a pause) enters only where its remaining tokens can repay the draft's
catch-up at the measured rates, one at a time while those are unmeasured or not paying, and none
while the gate's budget for tries, shared by all batch sizes, is spent.

Backing off: each request keeps a moving average of the drafts accepted per verification.  While
it is below ``min_accepted`` the request decodes plainly for a while (8 steps, doubling on every
relapse up to 128) and then tries again; on text that never repeats itself the proposer rarely
finds a match at all, and a match that proves wrong costs a few verifications, not a slower stream.
A new request's average starts at what its predecessors' verifications accepted lately (a moving
average over all of them), within ``min_accepted`` .. ``min_accepted + 1`` (the start before any):
where drafts have been failing, its first failed verification backs it off, not its fourth -- a
draft model's verification costs a few plain steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.engine.models.quantization_scheme import QUANTIZATIONS, Quantization
from common.engine.speculative.ngram import NgramProposer
from common.engine.speculative.step_cost import StepCostGate

METHODS = ("none", "ngram", "draft")
_FIRST_BACKOFF, _MAX_BACKOFF = 8, 128
_AVERAGE_WEIGHT = 0.3  # of the newest verification in a moving average (a request's, and all requests')
DEFERRED_DRAFT = -1  # a draft's place in a step's tokens until ``Speculation.complete_drafts`` fills it in


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings (declared once here; ``EngineConfig`` and the workers' flags
    take their defaults from this class)."""

    method: str = "none"  # none | ngram | draft (a draft model: ``draft_model``)
    num_tokens: int = 4  # draft tokens per request per step (k)
    ngram_min: int = 2  # shortest suffix that may match
    ngram_max: int = 4  # longest suffix tried first
    lookup_window: int = 4096  # tokens searched back from the end
    min_accepted: float = 0.5  # drafts accepted per verification below which a request backs off
    disable_batch_size: int = 0  # no speculation while more requests decode (0: never disabled)
    cost_gate: bool = True  # measure whether verifying pays per batch size, and pause where it does not
    draft_model: str | None = None  # the draft model's checkpoint (method "draft")
    # How the draft's weights are stored (``QUANTIZATIONS``): the target model itself quantized is a
    # draft of its own vocabulary that agrees with it on most tokens at a fraction of its reads.
    draft_quantization: str = Quantization.scheme
    # The tokens the draft's head scores: this many of its tokenizer's most common, and each
    # request's own (``draft_vocabulary``; 0: every token).  Gemma 3's 262,144-token head is most of
    # what a draft forward reads; a token outside costs only the drafts after it.
    draft_vocab_size: int = 32768

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, "speculative", self.method, f"one of {', '.join(METHODS)}"),
            (1 <= self.num_tokens <= 32, "num_speculative_tokens", self.num_tokens, "in 1..32"),
            (1 <= self.ngram_min <= self.ngram_max, "ngram_min", self.ngram_min, "in 1..ngram_max"),
            (self.ngram_max <= 64, "ngram_max", self.ngram_max, "<= 64"),
            (self.lookup_window > self.ngram_max, "ngram_lookup_window", self.lookup_window, "> ngram_max"),
            (self.min_accepted >= 0, "speculative_min_accepted", self.min_accepted, ">= 0"),
            (self.disable_batch_size >= 0, "speculative_disable_batch_size", self.disable_batch_size, ">= 0"),
            ((self.method == "draft") == bool(self.draft_model), "draft_model", self.draft_model,
             "set exactly when speculative is draft"),
            (self.draft_quantization in QUANTIZATIONS, "draft_quantization", self.draft_quantization,
             f"one of {', '.join(QUANTIZATIONS)}"),
            (self.draft_vocab_size >= 0, "draft_vocab_size", self.draft_vocab_size, ">= 0"),
        ]
        for ok, name, value, expected in checks:
            if not ok:
                raise ValueError(f"invalid config: {name} must be {expected}, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class _Track:
    """One request's acceptance and back-off."""

    average: float  # drafts accepted per verification (moving average)
    pause: int = 0  # steps left without speculation
    backoff: int = _FIRST_BACKOFF  # the next pause


@dataclass
class SpeculationStats:
    """Counters since start (the engine's ``stats`` and the workers' /metrics)."""

    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0
    verifications: int = 0  # request-steps that verified drafts
    backoffs: int = 0  # times a request stopped speculating for low acceptance
    # What a verification costs: decode-only steps that verified drafts, and those that did not.
    verify_steps: int = 0
    verify_step_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    batch_pauses: int = 0  # steps the batch decoded plainly because speculation did not pay (``step_cost``)

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_draft_tokens_total": self.draft_tokens,
            "spec_accepted_tokens_total": self.accepted_tokens,
            "spec_verifications_total": self.verifications,
            "spec_backoffs_total": self.backoffs,
            "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # Tokens each verification produced: the accepted drafts plus the model's own one.
            "spec_mean_tokens_per_verification":
                1 + self.accepted_tokens / self.verifications if self.verifications else 0.0,
            "spec_verify_steps_total": self.verify_steps,
            "spec_verify_step_seconds_total": self.verify_step_seconds,
            "decode_only_steps_total": self.decode_steps,
            "decode_only_step_seconds_total": self.decode_step_seconds,
            "spec_batch_paused_steps_total": self.batch_pauses,
        }


class Speculation:
    """Drafts for the scheduler (``draft``) and what became of them (``record``).

    A proposer has ``propose(request, num_tokens, block_ids) -> drafts`` (``block_ids``: the
    request's block table, slots for the drafts allocated, when it sets ``needs_slots_first``;
    else ``None``), ``forget(request_id)``, and optionally ``accepted(...)`` (see ``record``)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer=None):
        """``proposer``: the draft model's (``draft_model.DraftModelProposer``, built by the engine,
        which has the device and the pool); n-gram lookup is built here."""
        self.config = config
        self.max_model_len = max_model_len
        if config.method == "ngram":
            proposer = NgramProposer(config.ngram_min, config.ngram_max, config.lookup_window)
        self.proposer = proposer if config.enabled else None
        # a draft model's lag on a request (None: a proposer with nothing to catch up on, n-gram lookup)
        self._entry_tokens = getattr(self.proposer, "entry_tokens", None)
        self.stats = SpeculationStats()
        self.gate = StepCostGate() if config.cost_gate else None  # per batch size: does verifying pay
        self._tracks: dict[str, _Track] = {}
        self._prior = config.min_accepted + 1.0  # drafts accepted per verification lately, over all requests
        self._batch_allows = True
        self._num_decoding = 0
        self._trial: str | None = None  # the request let in while the rates were not yet measured
        self._deferred: dict[str, object] = {}  # request id -> request whose drafts ``complete_drafts`` fills in

    def begin_step(self, num_decoding: int) -> None:
        self._deferred.clear()
        self._num_decoding = num_decoding
        limit = self.config.disable_batch_size
        self._batch_allows = self.proposer is not None and (not limit or num_decoding <= limit)
        if self._batch_allows and num_decoding and self.gate is not None:
            self._batch_allows = self.gate.allows(num_decoding)
            self.stats.batch_pauses += not self._batch_allows

    def observe_step(self, scheduled, seconds: float, num_new_tokens: int) -> None:
        """A finished step (its ``ScheduledRequest`` list) that produced ``num_new_tokens``: decode-only
        steps are timed, with or without drafts, for the counters and the batch's gate."""
        if self.proposer is None or not all(item.sample and len(item.token_ids) == 1 + len(item.draft_token_ids)
                                            for item in scheduled):
            return  # off, or a prompt chunk in the step: not a decode step
        stats = self.stats
        verified = any(item.draft_token_ids for item in scheduled)
        if verified:
            stats.verify_steps += 1
            stats.verify_step_seconds += seconds
        else:
            stats.decode_steps += 1
            stats.decode_step_seconds += seconds
        # A draft model's catch-up (a request's entry: ``_entry_pays`` weighs it) is not what a
        # verification costs from step to step: the gate judges the steps that follow it, and counts
        # the catch-up in what the try cost.
        if self.gate is None:
            return
        if verified and getattr(self.proposer, "catching_up", False):
            self.gate.observe_catch_up(len(scheduled), num_new_tokens, seconds)
        else:
            self.gate.observe(len(scheduled), verified, num_new_tokens, seconds)

    def draft(self, request, budget: int, kv_manager, reserve_blocks: int = 0) -> list[int]:
        """Draft tokens for ``request`` (decoding, its next token's slot allocated), with slots for
        them allocated; ``[]`` when it does not speculate this step.  ``budget``: step tokens left;
        ``reserve_blocks``: free blocks the drafts' slots must leave (others' next tokens need them)."""
        if self.proposer is None or not self._batch_allows or not self._may_speculate(request):
            return []
        track = self._tracks.get(request.request_id)
        if track is None:
            start = min(max(self._prior, self.config.min_accepted), self.config.min_accepted + 1.0)
            track = self._tracks[request.request_id] = _Track(average=start)
        if track.pause:
            track.pause -= 1
            if not track.pause:
                track.average = self.config.min_accepted  # try again: one bad verification backs off
            return []
        # Never more than the request may still produce: accepting every draft yields one more token.
        room = min(request.sampling_params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        wanted = min(self.config.num_tokens, room, budget)
        if wanted <= 0 or not self._entry_pays(request, room):
            return []
        # No room for the drafts' slots: decode plainly rather than preempt anyone.
        if getattr(self.proposer, "needs_slots_first", False):  # its forwards write KV at them
            if kv_manager.allocate_slots(request, 1 + wanted, reserve_blocks=reserve_blocks) is None:
                return []
            if hasattr(self.proposer, "propose_batch"):  # drafted for the whole step: ``complete_drafts``
                self._deferred[request.request_id] = request
                return [DEFERRED_DRAFT] * wanted
            return self.proposer.propose(request, wanted, kv_manager.block_ids(request.request_id))
        drafts = self.proposer.propose(request, wanted, None)
        if drafts and kv_manager.allocate_slots(request, 1 + len(drafts), reserve_blocks=reserve_blocks) is None:
            return []
        return drafts

    def complete_drafts(self, scheduled) -> None:
        """Fill in the drafts ``draft`` deferred (``DEFERRED_DRAFT``s at the end of an item's
        ``token_ids``) for the step's ``ScheduledRequest`` list, in one batched proposal; a request
        preempted after it was drafted for is no longer among them and is left out."""
        if not self._deferred:
            return
        items = [item for item in scheduled if item.request_id in self._deferred and item.draft_token_ids]
        deferred, self._deferred = self._deferred, {}
        if not items:
            return
        from common.engine.speculative.draft_sampling import draft_uniforms  # torch: not for the configs

        wants = []
        for item in items:
            # a sampled request's rows' uniform numbers, drawn now: its drafts are sampled with them
            uniforms = draft_uniforms(item.sampling_params, item.num_output_tokens, len(item.draft_token_ids))
            item.draft_uniforms = uniforms or []
            wants.append((deferred[item.request_id], len(item.draft_token_ids), item.block_ids, uniforms))
        for item, drafts in zip(items, self.proposer.propose_batch(wants)):
            item.token_ids[len(item.token_ids) - len(drafts):] = drafts
            item.draft_token_ids = drafts

    def _entry_pays(self, request, room: int) -> bool:
        """Whether a draft model's catch-up on ``request`` (its prompt, the tokens of a pause) can pay
        for itself: what the request's remaining ``room`` tokens save at the measured rates (a plain
        step's share per token times 1 - plain / verifying) against what the draft takes to feed
        those tokens.  On a CPU where the draft costs about what the target does, a prompt's
        catch-up outweighs what a short answer gains.  Until the rates are measured, or while
        verifying does not pay, one request at a time enters this way (a trial: it costs one
        catch-up, not one per request of the batch).  No catch-up while the gate's budget for
        tries is spent (verifications lost more than plain steps earned), whatever the rates say."""
        entry_tokens = self._entry_tokens
        if entry_tokens is None or self.gate is None or entry_tokens(request) <= 1 + self.config.num_tokens:
            return True  # no catch-up to pay (n-gram lookup; a request drafted for last step)
        if self.gate.credit < 0:  # what tries may lose is spent (``step_cost``): rates learnt on other text aside
            return False
        per_token = self.proposer.seconds_per_fed_token
        rates = self.gate.rates(self._num_decoding)
        if rates is None or per_token is None or rates[1] <= rates[0]:
            if self._trial is not None and self._trial != request.request_id and self._trial in self._tracks:
                return False
            self._trial = request.request_id
            return True
        plain, verifying = rates
        saved = (room + 1) * (max(self._num_decoding, 1) / plain) * (1.0 - plain / verifying)
        return saved > entry_tokens(request) * per_token

    @staticmethod
    def _may_speculate(request) -> bool:
        return (request.num_output_tokens >= 1 and request.grammar is None and not request.hold_blocks_on_finish
                and not request.sampling_params.uses_penalties)

    def record(self, request_id: str, num_drafts: int, num_accepted: int, num_tokens_before: int) -> None:
        """A verification of ``num_drafts`` drafts kept ``num_accepted`` (the request had
        ``num_tokens_before`` tokens when they were proposed)."""
        if hasattr(self.proposer, "accepted"):
            self.proposer.accepted(request_id, num_tokens_before, num_drafts, num_accepted)
        stats = self.stats
        stats.draft_tokens += num_drafts
        stats.accepted_tokens += num_accepted
        stats.verifications += 1
        self._prior += _AVERAGE_WEIGHT * (num_accepted - self._prior)
        track = self._tracks.get(request_id)
        if track is None:
            return
        track.average += _AVERAGE_WEIGHT * (num_accepted - track.average)
        if track.average < self.config.min_accepted:
            stats.backoffs += 1
            track.pause = track.backoff
            track.backoff = min(2 * track.backoff, _MAX_BACKOFF)
        elif num_accepted:
            track.backoff = max(_FIRST_BACKOFF, track.backoff // 2)

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted): drop what was kept for it."""
        self._tracks.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)
