"""A request as the engine sees it: token ids, how many are computed, and its state."""
from __future__ import annotations

import enum
import logging
import time
from typing import Sequence

from common.engine.kv.prefix_hash import BlockHash, hash_prompt_blocks
from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import GrammarMatcher

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode role: blocks reserved, KV in flight
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; recomputed when admitted again
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context length
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished state."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    """One generation request.  There are no phases: the scheduler only compares
    ``num_computed_tokens`` with ``num_tokens`` and hands out tokens to compute.

        all_token_ids:   [ prompt ............ | output ...... ]
        num_computed_tokens:  ^--- KV exists for everything left of here
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        extra_keys: bytes = b"",
        grammar: GrammarMatcher | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first admitted (for metrics and tests).
        self.num_cached_tokens: int | None = None  # prompt tokens found cached when it was admitted
        self.num_preemptions = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # What the block hashes cover besides the tokens (``prefix_hash.block_extra_keys``: the
        # model and the request's cache_salt): requests with other extra keys share no block.
        self.extra_keys = extra_keys
        self.block_hashes: list[BlockHash] = []
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        # Prefill role: blocks stay referenced after the prompt finishes, until the KV is shipped.
        self.hold_blocks_on_finish = False
        self.stop_reason: int | None = None
        # The request's position in its grammar (``sampling_params.structured``): it advances with
        # every output token but a stop token, and survives preemption (no output token is undone).
        self.grammar = grammar
        self.error: str | None = None  # why it ended with an error, where it did (its grammar failed)
        # ``sampling_params.prompt_logprobs``: the prompt tokens scored so far (entry i scores token
        # i + 1, ``TokenLogprobs``) until the first output takes them; the count survives preemption,
        # so a prompt computed again is not scored twice.
        self.prompt_logprobs: list = []
        self.num_scored_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Prompt tokens are still to be scored (``prompt_logprobs``): the prompt is computed whole,
        never read from the prefix cache."""
        return self.sampling_params.prompt_logprobs is not None and self.num_scored_tokens < self.num_prompt_tokens - 1

    def prompt_scored_elsewhere(self) -> None:
        """Its prompt was scored by another worker (a remote prefill, the worker a moved stream
        left): nothing is scored here, should the prompt be computed here again."""
        self.num_scored_tokens = self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_token(self, token_id: int, max_model_len: int) -> None:
        """Append ``token_id`` as the next output token, advancing the grammar, and finish the
        request if it ends it (``status_after_token``; or the grammar is complete)."""
        status = status_after_token(self, token_id, max_model_len)
        if self.grammar is not None:
            failure = self.grammar.error()  # (its mask allowed nothing it means: not even this stop token)
            if failure is None and token_id in self.stop_token_ids and not self.grammar.may_end():
                failure = f"it names stop token {token_id} where its output may not end"
            elif failure is None and token_id not in self.stop_token_ids and not self.grammar.accept(token_id):
                failure = self.grammar.error() or f"the grammar refused token {token_id} its mask allowed"
            if failure is not None:
                self._grammar_failed(failure)
                status = RequestStatus.FINISHED_ERROR
            elif status is None and token_id not in self.stop_token_ids and self.grammar.is_stopped():
                status = RequestStatus.FINISHED_STOPPED
        self.append_output_token(token_id)
        if status is RequestStatus.FINISHED_STOPPED:
            self.stop_reason = token_id
        if status is not None:
            self.status = status

    def _grammar_failed(self, failure: str) -> None:
        """Its grammar cannot go on (a limit on its work passed): it ends with an error naming why."""
        spec = self.sampling_params.structured
        field = spec.field if spec is not None else "structured output"
        self.error = (f"{field}: the grammar could not be followed past output token {self.num_output_tokens} "
                      f"({failure}); simplify it")
        log.warning("request %s: %s", self.request_id, self.error)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend the chained hashes to every full block of the tokens known so far."""
        if len(self.block_hashes) < self.num_tokens // block_size:
            self.block_hashes = hash_prompt_blocks(self.all_token_ids, block_size, self.extra_keys,
                                                   start_hashes=self.block_hashes)
        return self.block_hashes

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens})"
        )


def status_after_token(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """What appending ``token_id`` as its next output token makes of ``request``: finished by a
    stop token or by length, or ``None`` if it goes on.  Reads the request only, so a decode worker
    can tell before a remote prompt lands whether its first token ends it."""
    if token_id in request.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if (request.num_output_tokens + 1 >= request.sampling_params.max_tokens
            or request.num_tokens + 1 >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


def grammar_verdict(request: Request, token_id: int) -> str:
    """What ``token_id`` as the next output token does to the request's grammar, without advancing
    it: ``"open"`` (no grammar, a stop token, or the grammar goes on), ``"stopped"`` (it completes
    the grammar) or ``"rejected"`` (the grammar forbids it)."""
    if request.grammar is None or token_id in request.stop_token_ids:
        return "open"
    return request.grammar.probe(token_id)


def resume_request(request: Request, token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Make ``token_ids`` -- output tokens a lost or draining worker already streamed for this
    request -- the fresh ``request``'s first outputs, as if it had produced them itself: they count
    toward ``max_tokens``, ``min_tokens`` and the penalties, the next token is sampled at the next
    output index (a seeded request draws what it would have drawn), and its grammar has advanced
    through them.  The request then computes the KV of its prompt and these tokens as a preempted
    one does, and samples on.  Raises ``ValueError`` (naming ``resume_token_ids``) for tokens the
    request could not have produced and gone on: a stop token, past a limit, or against its grammar."""
    tokens = list(token_ids)
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in tokens):
        raise ValueError(f"resume_token_ids must be integers in [0, {vocab_size})")
    if len(tokens) >= request.sampling_params.max_tokens or request.num_tokens + len(tokens) >= max_model_len:
        raise ValueError("resume_token_ids: the request would already have ended by length")
    for i, token_id in enumerate(tokens):
        if token_id in request.stop_token_ids:
            raise ValueError(f"resume_token_ids[{i}] is a stop token: the request would already have ended")
        if request.grammar is not None and not request.grammar.accept(token_id):
            raise ValueError(f"resume_token_ids[{i}] breaks the request's grammar")
        request.append_output_token(token_id)
    if request.grammar is not None and request.grammar.is_stopped():
        raise ValueError("resume_token_ids complete the request's grammar: the request would already have ended")
