"""Which chat template turns ``messages`` into a prompt, for checkpoints with or without one.

In order: ``--chat-template`` (a file, or the Jinja template itself, as vLLM takes it), then the
checkpoint's own template, then a built-in turn format for model families whose base checkpoints
ship none -- Gemma's, so the default model (a base Gemma 3 whose GGUF carries no template) serves
``/v1/chat/completions`` out of the box::

    <bos><start_of_turn>user
    {system prompt, if any}

    {first user message}<end_of_turn>
    <start_of_turn>model
    {assistant message}<end_of_turn>
    ...
    <start_of_turn>model

A built-in format also names the token that ends a turn (``<end_of_turn>``): chat requests stop
there, as the instruction-tuned checkpoints' generation configs do.  Without any template, chat
requests get a 400 naming the problem.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class BuiltinFormat:
    template: str
    end_of_turn: str  # the token that ends a turn: chat requests stop on it


BUILTIN = {model_type: BuiltinFormat(GEMMA_TURNS, "<end_of_turn>")
           for model_type in ("gemma", "gemma2", "gemma3", "gemma3_text")}


@dataclass(frozen=True)
class ChatFormat:
    """The template in use (None: chat is refused), where it came from, and the token ids that
    end a turn (added to a chat request's stop tokens)."""

    template: str | None
    source: str
    stop_token_ids: tuple[int, ...] = ()


def load_chat_template(value: str) -> str:
    """``--chat-template``: the contents of a file, or the value itself if it is a Jinja template."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {path}: {exc}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


def resolve_chat_format(tokenizer: Any, model_type: str, override: str | None = None) -> ChatFormat:
    """Choose the template (module docstring) and check that it renders; raises ValueError."""
    builtin = None
    if override:
        template, source = load_chat_template(override), "--chat-template"
    elif getattr(tokenizer, "chat_template", None):
        template, source = tokenizer.chat_template, "the checkpoint"
    elif model_type in BUILTIN:
        builtin = BUILTIN[model_type]
        template, source = builtin.template, f"the built-in {model_type} turn format"
    else:
        return ChatFormat(None, "none")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template,
                                      add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise ValueError(f"the chat template from {source} does not render: {exc}") from None
    stop: tuple[int, ...] = ()
    if builtin is not None:
        token_id = tokenizer.convert_tokens_to_ids(builtin.end_of_turn)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            stop = (token_id,)
    return ChatFormat(template, source, stop)
