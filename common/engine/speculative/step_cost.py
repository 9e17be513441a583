"""Whether speculation pays for the batch as it is: output tokens per second of the steps that
verify drafts against those of plain decode steps, per batch size.

A verification computes k + 1 positions per request.  Where a step costs about the same whatever
its size (one request, weights read once), every accepted draft is a token for free; where the
step is compute-bound (a large batch, an int8 kernel whose cost grows with its rows, a 262k-token
LM head projected for every position) the same acceptance can make decoding slower.  So the engine
measures instead of predicting: for each batch-size bucket it keeps a moving average of both rates
over decode-only steps, speculates while the verifying rate is at least the plain one, and else
decodes plainly for a while (``_FIRST_PAUSE`` steps, doubling on every relapse up to ``_MAX_PAUSE``)
before measuring speculation again -- from its first verifying step after a relapse (a try that
costs several times a plain step would otherwise cost its first ``_MIN_SAMPLES`` steps every time).
A try that lost much -- a draft model's verification several times a plain step, its catch-up on
the tokens of the pause (``observe_catch_up``) -- pauses at least long enough that it cost no more
than ``_TRY_BUDGET`` of the pause's plain time: what failed tries cost is bounded by measurement,
however expensive a try is, rather than by how many doublings the run lasts.  Where the average took
several losing steps to fall below the plain rate (learned while speculation paid), all of them count.
The plain rate is measured by pausing for a few steps once the verifying rate is known, and again
every ``_REFRESH`` verifying steps (the load changes).

Tries share one budget across batch sizes (``credit``, seconds): every plain step earns
``_TRY_BUDGET`` of its time, every verifying or catch-up step spends what it lost against its
bucket's plain rate (or earns what it gained), and a try -- a bucket's first, one after a pause, a
draft model's catch-up on a request (``Speculation``) -- waits while the budget is spent.  A batch
whose size wanders across buckets (requests finishing at the tail of a burst: 8, then 4, 2, 1) would
otherwise pay a losing first try in every bucket it passes through, and a request's catch-ups after
its own back-offs are never judged as verifying steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_WEIGHT = 0.3  # of the newest step in a moving average
_MIN_SAMPLES = 3  # steps of a kind before its rate counts
_PROBE = 3  # plain steps taken to measure the plain rate
_FIRST_PAUSE, _MAX_PAUSE = 16, 512
_REFRESH = 128  # verifying steps after which the plain rate is measured again
_TRY_BUDGET = 0.02  # of a pause's plain time, what the failed try before it may have lost (and the share of
# every plain step's time that the shared budget earns)
_MAX_SIZED_PAUSE = 8 * _MAX_PAUSE
# The shared budget holds at most this many plain steps' time: what speculation gained on text that
# suited it does not pay for many losing tries once the text changes.
_MAX_CREDIT_STEPS = 4


@dataclass
class _Rate:
    value: float = 0.0
    samples: int = 0

    def add(self, rate: float) -> None:
        self.value = rate if not self.samples else self.value + _WEIGHT * (rate - self.value)
        self.samples += 1

    @property
    def known(self) -> bool:
        return self.samples >= _MIN_SAMPLES


@dataclass
class _Bucket:
    plain: _Rate
    verifying: _Rate
    pause: int = 0  # plain steps left before speculating again
    next_pause: int = _FIRST_PAUSE
    since_plain: int = 0  # verifying steps since the plain rate was last measured
    relapsed: bool = False  # paused before: one verifying step judges the next try
    judged: float | None = None  # the verifying rate the last judgment saw
    # What a relapse's pause is sized by: the verifying and catch-up steps since the last pause or
    # the last step that paid by its own rate -- their time and their tokens.
    try_seconds: float = 0.0
    try_tokens: int = 0
    # Verifying and catch-up steps seen before the plain rate was known: the shared budget is
    # charged for them once it is.
    unpriced_seconds: float = 0.0
    unpriced_tokens: int = 0

    def add_to_try(self, tokens: int, seconds: float) -> None:
        self.try_seconds += seconds
        self.try_tokens += tokens


def batch_bucket(num_decoding: int) -> int:
    """1, 2, 4, 8, ...: batches of about the same size share their measurements."""
    return 1 << max(0, num_decoding - 1).bit_length()


class StepCostGate:
    """Per batch-size bucket: may this step speculate (``allows``), and what a step showed (``observe``)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self.credit = 0.0  # seconds tries may still lose (the module docstring's shared budget)

    def _bucket(self, num_decoding: int) -> _Bucket:
        key = batch_bucket(num_decoding)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(_Rate(), _Rate())
        return self._buckets[key]

    def allows(self, num_decoding: int) -> bool:
        """Called once per step that has ``num_decoding`` decoding requests."""
        bucket = self._bucket(num_decoding)
        if bucket.pause:
            bucket.pause -= 1
            return False
        trying = not bucket.verifying.samples and (bucket.judged is None or bucket.relapsed)
        return not (trying and self.credit < 0)

    def rates(self, num_decoding: int) -> tuple[float, float] | None:
        """The plain and the verifying rate (tokens a second) at this batch size, once both are known
        (the verifying one as the last judgment saw it while it is measured afresh)."""
        bucket = self._bucket(num_decoding)
        verifying = bucket.verifying.value if bucket.verifying.known else bucket.judged
        if not bucket.plain.known or verifying is None:
            return None
        return bucket.plain.value, verifying

    def observe_catch_up(self, num_decoding: int, tokens: int, seconds: float) -> None:
        """A decode-only step that verified while a draft model caught up on some request (its
        prompt, a pause's tokens): part of what the try costs, not a verifying rate."""
        if seconds > 0 and num_decoding:
            bucket = self._bucket(num_decoding)
            bucket.add_to_try(tokens, seconds)
            self._account(bucket, num_decoding, tokens, seconds)

    def observe(self, num_decoding: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode-only step (no prompt chunk in it) produced ``tokens`` in ``seconds``."""
        if seconds <= 0 or not num_decoding:
            return
        bucket, rate = self._bucket(num_decoding), tokens / seconds
        if not verified:
            bucket.plain.add(rate)
            self._account(bucket, num_decoding, tokens, seconds, verified=False)
            return
        self._account(bucket, num_decoding, tokens, seconds)
        bucket.verifying.add(rate)
        bucket.since_plain += 1
        bucket.add_to_try(tokens, seconds)
        if not (bucket.verifying.known or (bucket.relapsed and bucket.plain.known)):
            return
        if not bucket.plain.known or bucket.since_plain >= _REFRESH:
            bucket.plain = _Rate()  # measure it (again) now; the try goes on after it
            bucket.pause, bucket.since_plain = _PROBE, 0
            return
        bucket.judged = bucket.verifying.value
        if bucket.verifying.value < bucket.plain.value:
            bucket.pause = max(bucket.next_pause, _pause_for(bucket, num_decoding))
            bucket.next_pause = min(2 * bucket.next_pause, _MAX_PAUSE)
            bucket.verifying = _Rate()  # judged afresh when it resumes
            bucket.relapsed = True
        else:
            bucket.next_pause = max(_FIRST_PAUSE, bucket.next_pause // 2)
            bucket.relapsed = False
            if rate < bucket.plain.value:
                return  # a step that lost, outweighed by the average so far: the try's cost goes on
        bucket.try_seconds, bucket.try_tokens = 0.0, 0

    def _account(self, bucket: _Bucket, num_decoding: int, tokens: int, seconds: float, verified: bool = True) -> None:
        """The shared budget after a step (see the module docstring); a verifying step before its
        bucket's plain rate is known is charged once it is."""
        priced = bucket.plain.known and bucket.plain.value > 0  # (plain steps whose outputs were all dropped: no rate)
        if not verified:
            self.credit += _TRY_BUDGET * seconds
            if priced and bucket.unpriced_seconds:
                self.credit -= bucket.unpriced_seconds - bucket.unpriced_tokens / bucket.plain.value
                bucket.unpriced_seconds, bucket.unpriced_tokens = 0.0, 0
        elif priced:
            self.credit -= seconds - tokens / bucket.plain.value
        else:
            bucket.unpriced_seconds += seconds
            bucket.unpriced_tokens += tokens
        if priced:
            self.credit = min(self.credit, _MAX_CREDIT_STEPS * num_decoding / bucket.plain.value)


def _pause_for(bucket: _Bucket, num_decoding: int) -> int:
    """The plain steps after which the try just judged cost at most ``_TRY_BUDGET`` of their time:
    its time less what plain decoding takes for its tokens, over the budget of one plain step
    (``num_decoding`` tokens at the plain rate)."""
    if bucket.plain.value <= 0:
        return 0
    lost = bucket.try_seconds - bucket.try_tokens / bucket.plain.value
    plain_step = num_decoding / bucket.plain.value
    return min(_MAX_SIZED_PAUSE, math.ceil(max(0.0, lost) / (_TRY_BUDGET * plain_step)))
