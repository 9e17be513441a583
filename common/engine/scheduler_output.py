"""What the scheduler hands the model runner each step: ``SchedulerOutput``, one ``ScheduledRequest``
per request it computes."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import GrammarMatcher


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions starting at
    ``num_computed_tokens``, writing KV into ``block_ids``; sample a token if ``sample``.

    A speculating request's ``token_ids`` end with its ``draft_token_ids`` (``common.engine.speculative``):
    the step samples after each of them too, and keeps the drafts the model agrees with."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # before this step; makes seeded sampling stateless
    # The request's own lists (not copies), read by the sampler for penalties.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # The request's row in ``KVCacheManager.table``, the persistent form of ``block_ids``.
    table_row: int | None = None  # its row in the persistent block table
    # The request's own: what ends it (min_tokens holds these back) and its grammar's matcher.
    stop_token_ids: frozenset[int] | set[int] = frozenset()
    grammar: GrammarMatcher | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    # The uniform numbers the rows after each draft sample with, where the drafts were sampled with
    # them (a draft model's, for a sampled request: ``speculative.draft_sampling``); else empty.
    draft_uniforms: list[float] = field(default_factory=list)
    # The slice's rows ``[start, end)`` (offsets in ``token_ids``) whose next prompt token is scored
    # for ``sampling_params.prompt_logprobs`` (``common.engine.prompt_logprobs``); (0, 0): none.
    prompt_logprob_rows: tuple[int, int] = (0, 0)


@dataclass
class SchedulerOutput:
    """What one step does: the requests it computes (``scheduled``, each with its share), the
    tokens they compute in all, and the requests it preempted (their blocks freed; each is
    computed again from its first token when admitted again)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
