"""vLLM's ``chat_template_kwargs``: variables a chat request hands its chat template (Qwen 3's
``enable_thinking``, a template's own switches), read within bounds.

They are rendered in jinja2's sandbox like the messages, so they can do nothing a template cannot.
They may not take the names of ``apply_chat_template``'s own parameters (the request sets those
through its fields: ``messages``, ``tools``, ``add_generation_prompt``, ...; the renderer checks the
installed transformers' signature too, ``check_not_parameters``), of the special tokens transformers
hands every template, or of the functions templates call.  Their JSON is refused past
``MAX_TEMPLATE_KWARGS_BYTES`` before it is decoded -- switches are small, and a template may render a
variable once per message.
"""
from __future__ import annotations

import inspect
from typing import Any

import msgspec

from gateway.openai_errors import from_msgspec, invalid

MAX_TEMPLATE_KWARGS_BYTES = 8 * 1024
MAX_TEMPLATE_KWARGS = 64
RESERVED = frozenset({
    # apply_chat_template's parameters (transformers 4.4x-5.x) and the names it renders messages under
    "self", "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
    # the special tokens every template is handed
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
    # the functions templates call (transformers' and jinja2's globals): a variable would hide one
    "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace",
})
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
    _refuse(sorted(RESERVED.intersection(kwargs)))
    return kwargs


def check_not_parameters(kwargs: dict[str, Any], apply_chat_template) -> None:
    """A 400 where a variable has the name of one of ``apply_chat_template``'s parameters (the
    installed transformers may have more than ``RESERVED`` knows)."""
    if kwargs:
        _refuse(sorted(set(inspect.signature(apply_chat_template).parameters).intersection(kwargs)))


def _refuse(taken: list[str]) -> None:
    if taken:
        raise invalid(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields, the "
                      "template's special tokens or its functions)", "chat_template_kwargs")
