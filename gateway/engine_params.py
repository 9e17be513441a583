"""A request's choice as the engine runs it: its ``SamplingParams``, checked against the served model
(the context, the vocabulary) -- every refusal a 400 naming the field at fault."""
from __future__ import annotations

from common.engine.sampling_params import SamplingParams
from gateway.openai_errors import invalid
from gateway.sampling_options import SamplingOptions
from gateway.tools_request import ToolPlan


def engine_params(options: SamplingOptions, kind: str, echo: bool, prompt_ids: list[int], plan: ToolPlan | None, *,
                  max_model_len: int, vocab_size: int, turn_end: tuple[int, ...],
                  bound_field: str = "max_tokens") -> tuple[SamplingParams, bool]:
    """The engine's parameters of a ``kind`` ("completion", "chat") request's choice over ``prompt_ids``
    (``echo``: a completion that repeats its prompt; ``turn_end``: the chat format's end-of-turn
    tokens), and whether the prompt alone is answered (``max_tokens: 0`` with echo).  ``bound_field``:
    the request's name for ``options.max_tokens`` (``max_completion_tokens``, ``max_output_tokens``),
    which a refusal of it names."""
    if not prompt_ids:
        raise invalid("the prompt is empty after tokenization", "prompt")
    # Sizes before any per-token work: the length bounds the scan of the ids below.
    room = max_model_len - len(prompt_ids)
    max_tokens = options.max_tokens if options.max_tokens is not None else room
    # max_tokens=0 with echo: the prompt alone is answered; one token is generated (and counted), as in vLLM.
    echo_only = max_tokens == 0
    max_tokens = max(max_tokens, 1)
    if room < 1 or max_tokens > room:
        # the prompt alone is too long: its field is at fault (truncate_prompt_tokens cuts it), else the bound
        field = bound_field if room >= 1 else "prompt" if kind == "completion" else "messages"
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or {bound_field}.", field, "context_length_exceeded")
    if options.min_tokens > max_tokens:  # (vLLM refuses it too; else no output could meet it)
        bound = (f"{bound_field} ({options.max_tokens})" if options.max_tokens is not None
                 else f"the {max_tokens} tokens the context leaves after the prompt")
        raise invalid(f"min_tokens ({options.min_tokens}) must be at most {bound}", "min_tokens")
    if max(prompt_ids) >= vocab_size:  # ids are >= 0 (decoded so, or from the tokenizer)
        bad = next(t for t in prompt_ids if t >= vocab_size)
        raise invalid(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    # A top_k at or above the vocabulary keeps every token: clamp it (as vLLM does), so a huge
    # value never reaches the workers' messages.
    top_k = options.top_k if options.top_k is not None and options.top_k < vocab_size else 0
    for name, ids in (("logit_bias", [t for t, _ in options.logit_bias]), ("stop_token_ids", options.stop_token_ids)):
        if ids and max(ids) >= vocab_size:
            raise invalid(f"{name}: token id {max(ids)} is outside the vocabulary [0, {vocab_size})", name)
    # echo with logprobs scores the prompt's tokens too, as vLLM's prompt_logprobs does (each
    # choice's workers compute its prompt whole; the request's scores in all are bounded).
    asked = [k for k in (options.prompt_logprobs, options.logprobs if kind == "completion" and echo else None)
             if k is not None]
    # A built-in chat format's end-of-turn token ends a chat answer (unless EOS is ignored).
    turn_end = turn_end if kind == "chat" and not options.ignore_eos else ()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=options.temperature, top_k=top_k,
        top_p=options.top_p, min_p=options.min_p, presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty, repetition_penalty=options.repetition_penalty,
        seed=options.seed, ignore_eos=options.ignore_eos,
        # best_of ranks its candidates by their tokens' logprobs: the chosen token's at least
        logprobs=options.logprobs if options.best_of is None else options.logprobs or 0,
        stop_token_ids=tuple(dict.fromkeys(turn_end + options.stop_token_ids)),
        logit_bias=options.logit_bias, min_tokens=options.min_tokens,
        structured=options.structured or (plan.structured if plan else None),
        prompt_logprobs=max(asked) if asked else None,
    )
    return params, echo_only
