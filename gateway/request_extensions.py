"""The fields OpenAI and vLLM document for completions and chat beyond the ones every request uses:
honoured where they mean something here, accepted where they change nothing here, and refused --
a 400 naming the field, code ``unsupported_value`` -- only where a value asks for what this gateway
does not do (an unknown name stays a 400 ``unknown_parameter``: gateway/openai_errors.py).

    honoured                 skip_special_tokens, include_stop_str_in_output, add_special_tokens,
                             truncate_prompt_tokens (keep the prompt's last k tokens; -1: as many as the
                             context holds beside the output),
                             request_id (the answer's id; the ``X-Request-Id`` header wins, as in vLLM)
    accepted, no effect      spaces_between_special_tokens (fast tokenizers ignore it, as in vLLM's),
                             length_penalty (beam search's), service_tier (one tier), prompt_cache_key
                             (the router finds shared prefixes itself), prediction (an output's
                             expected text: speed only), reasoning_effort and verbosity (hints; this
                             model does not reason), priority (served first come, first served, as
                             vLLM's default scheduler), modalities ["text"], detokenize
                             true, use_beam_search / return_token_ids / return_tokens_as_token_ids
                             false, a chat's echo false
    null (or absent) only    logits_processors, vllm_xargs, kv_transfer_params, bad_words,
                             allowed_token_ids, chat_template (the gateway's --chat-template), documents,
                             mm_processor_kwargs, web_search_options, audio, functions, function_call

The null-only fields are typed null: another value is refused as it is read (nothing a body holds
there is built into objects first), "Expected `null`" naming the field.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gateway.openai_errors import invalid

_NULL = msgspec.Raw(b"null")
# The answer's id as the client names it: what ``X-Request-Id`` may hold too (printable, no space).
RequestIdText = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
REQUEST_ID_HEADER = "X-Request-Id"
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]  # OpenAI's (one tier here, whichever is asked)
PromptCacheKey = Annotated[str, msgspec.Meta(max_length=1024)]  # OpenAI's routing hint
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
Verbosity = Literal["low", "medium", "high"]
_REFUSED_VALUES = {  # field -> (the value it may hold besides null, why another is refused)
    "detokenize": (True, "answers are text (detokenize: false is not offered)"),
    "use_beam_search": (False, "beam search is not offered"),
    "return_token_ids": (False, "answers carry no token ids (use logprobs, or /tokenize)"),
    "return_tokens_as_token_ids": (False, "logprobs name tokens by their text"),
    "modalities": (["text"], "the served model reads and writes text only"),
}


# Taken but left out of the OpenAPI document: they ask for nothing here (and each one more field
# there leaves the request schemas too complex for a generator such as schemathesis to fill).
UNDOCUMENTED = ("spaces_between_special_tokens", "length_penalty", "service_tier", "prompt_cache_key", "prediction",
                "reasoning_effort", "verbosity", "modalities", "priority", "detokenize", "use_beam_search",
                "return_token_ids", "return_tokens_as_token_ids", "logits_processors", "vllm_xargs",
                "kv_transfer_params", "bad_words", "allowed_token_ids", "chat_template", "documents",
                "mm_processor_kwargs", "web_search_options", "audio", "functions", "function_call")


def given(raw: msgspec.Raw) -> bool:
    """A field kept as ``msgspec.Raw`` was sent, and not as null."""
    return len(raw) > 0 and raw != _NULL


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's predicted output: text the answer is expected to repeat (its content kept as JSON)."""

    type: Literal["content"]
    content: msgspec.Raw


class RequestExtensions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields of the module's table, shared by both endpoints' requests (``_Common``); ``None``
    means "as when not sent".  ``check_extensions`` refuses what they ask for that is not offered."""

    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None  # completions: true; chat: false (the template has them)
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    request_id: RequestIdText | None = None
    spaces_between_special_tokens: bool | None = None
    length_penalty: float | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: PromptCacheKey | None = None
    prediction: Prediction | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
    # (a longer list is refused once read: its elements are the two literals, nothing built for each)
    modalities: Annotated[list[Literal["text", "audio"]], msgspec.Meta(max_length=2)] | None = None
    priority: int | None = None
    detokenize: bool | None = None
    use_beam_search: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    logits_processors: None = None
    vllm_xargs: None = None
    kv_transfer_params: None = None
    bad_words: None = None
    allowed_token_ids: None = None
    chat_template: None = None
    documents: None = None
    mm_processor_kwargs: None = None
    web_search_options: None = None
    audio: None = None
    functions: None = None
    function_call: None = None


def check_extensions(req: RequestExtensions, chat: bool = False) -> None:
    """A 400 naming the first field that asks for what is not offered (the module's table; ``chat``:
    a chat request, whose ``echo`` is this table's)."""
    if chat and req.echo:
        raise invalid("echo: a chat answer does not repeat the last message (continue_final_message goes on from "
                      "it)", "echo", "unsupported_value")
    for name, (allowed, why) in _REFUSED_VALUES.items():
        value = getattr(req, name, None)
        if value is not None and value != allowed:
            raise invalid(f"{name}: {why}", name, "unsupported_value")
    if req.truncate_prompt_tokens == 0:
        raise invalid("truncate_prompt_tokens keeps the prompt's last k tokens: k >= 1 (or -1: the context)",
                      "truncate_prompt_tokens")


def truncated(prompt_ids: list[int], keep: int | None, max_model_len: int, output_tokens: int | None,
              lead: int = 0) -> list[int]:
    """The prompt's last ``keep`` tokens (None: all of them; -1: as many as the context holds beside
    the ``output_tokens`` asked for -- at least one; past the context: the context's worth), its
    first ``lead`` (the tokenizer's BOS) kept among them, as vLLM truncates a text before adding it."""
    if keep is None:
        return prompt_ids
    keep = max(max_model_len - max(output_tokens or 1, 1), 1) if keep == -1 else min(keep, max_model_len)
    if len(prompt_ids) <= keep:
        return prompt_ids
    lead = min(lead, keep - 1)
    return prompt_ids[:lead] + prompt_ids[len(prompt_ids) - (keep - lead):]


def added_bos(tokenizer, prompt: str | list[int], ids: list[int]) -> int:
    """1 where tokenizing the text ``prompt`` put the tokenizer's BOS first (``truncated`` keeps it), else 0
    (token ids are the client's, as sent)."""
    return int(isinstance(prompt, str) and ids[:1] == [getattr(tokenizer, "bos_token_id", None)])


def echoed_prompt(tokenizer, prompt: str | list[int], whole: list[int], ids: list[int], lead: int) -> str:
    """What ``echo`` repeats of ``prompt`` (its tokens ``whole``) served as ``ids`` (``truncated``'s, ``lead``
    the BOS it kept first): a text served whole as it was sent; a cut text as the text its kept tokens
    make, without that BOS (the tokenizer's, not the client's); token ids as their text, every one
    (as vLLM echoes them)."""
    if ids is whole and isinstance(prompt, str):
        return prompt
    return tokenizer.decode(ids[lead:] if len(ids) > 1 else ids)


def client_request_id(headers, req: RequestExtensions) -> str | None:
    """The id the client gave the request: its ``X-Request-Id`` header (400 where it is not
    printable ASCII of at most 128 characters), else the body's ``request_id``; None: neither."""
    header = headers.get(REQUEST_ID_HEADER)
    if header is None:
        return req.request_id
    if not is_request_id(header):
        raise invalid(f"the {REQUEST_ID_HEADER} header must be 1-128 printable ASCII characters without spaces",
                      REQUEST_ID_HEADER)
    return header


def is_request_id(text: str) -> bool:
    """Whether ``text`` may name a request (``RequestIdText``)."""
    try:
        msgspec.convert(text, RequestIdText)
    except msgspec.ValidationError:
        return False
    return True


def answer_id(headers, req: RequestExtensions, prefix: str) -> str | None:
    """The answer's id where the client named the request (``prefix-<its id>``, as vLLM's), else None."""
    named = client_request_id(headers, req)
    return None if named is None else f"{prefix}-{named}"
