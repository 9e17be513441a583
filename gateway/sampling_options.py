"""The validated, defaulted generation knobs of one OpenAI-style request (``SamplingOptions``), read from
its fields by ``sampling_options`` (gateway/openai_protocol.py's requests call it)."""
from __future__ import annotations

from dataclasses import dataclass

from common.engine.structured.spec import StructuredOutput


@dataclass(frozen=True)
class SamplingOptions:
    """The validated, defaulted generation knobs of one request (engine-neutral).

    ``max_tokens is None``: generate until EOS, a stop, or the context limit.
    ``logprobs is None``: none; ``k``: the sampled token's logprob plus the top ``k``.
    """

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int | None
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # vLLM's: the answer's text leaves special tokens out
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string that ended it stays
    best_of: int | None = None  # a completion's candidates per prompt, where more than n (the best n answered)
    n: int = 1  # choices answered per prompt


def sampling_options(req, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
    """``req``'s knobs (a completion or chat request: the fields they share), ``max_tokens`` and ``logprobs``
    as that endpoint names them."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k if req.top_k and req.top_k > 0 else None,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        stream=req.stream,
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage
                              and req.stream_options.continuous_usage_stats),  # (as vLLM: with include_usage)
        structured=req.response_format or req.structured_outputs,
        logit_bias=tuple(sorted((req.logit_bias or {}).items())),
        min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens is not False,
        include_stop=bool(req.include_stop_str_in_output),
        best_of=best_of if (best_of := getattr(req, "best_of", None)) and best_of > req.n else None,
        n=req.n,
    )
