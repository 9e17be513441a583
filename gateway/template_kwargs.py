"""vLLM's ``chat_template_kwargs``: variables a chat request hands its chat template (Qwen 3's
``enable_thinking``, a template's own switches), read within bounds.

They are rendered in jinja2's sandbox like the messages, so they can do nothing a template cannot;
they may not take the names of ``apply_chat_template``'s own parameters (which the request sets
through its fields: ``messages``, ``tools``, ``add_generation_prompt``, ...), and their JSON is
refused past ``MAX_TEMPLATE_KWARGS_BYTES`` before it is decoded.
"""
from __future__ import annotations

from typing import Any

import msgspec

from gateway.openai_errors import from_msgspec, invalid

MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
MAX_TEMPLATE_KWARGS = 64
# apply_chat_template's own parameters (and the names it renders the messages under), and the
# functions templates call (transformers' and jinja2's globals): a variable of that name would hide one
RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                      "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace"})
_decoder = msgspec.json.Decoder(dict[str, Any], strict=False)


def read_template_kwargs(raw: msgspec.Raw) -> dict[str, Any]:
    """The body's ``chat_template_kwargs`` (a JSON object), or a 400 naming the field."""
    if len(raw) > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(f"chat_template_kwargs is {len(raw)} bytes of JSON; at most {MAX_TEMPLATE_KWARGS_BYTES} are "
                      "allowed", "chat_template_kwargs")
    try:
        kwargs = _decoder.decode(raw)
    except msgspec.MsgspecError as exc:
        raise from_msgspec(exc, "chat_template_kwargs") from None
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise invalid(f"chat_template_kwargs holds at most {MAX_TEMPLATE_KWARGS} variables", "chat_template_kwargs")
    taken = sorted(RESERVED.intersection(kwargs))
    if taken:
        raise invalid(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields do)",
                      "chat_template_kwargs")
    return kwargs
