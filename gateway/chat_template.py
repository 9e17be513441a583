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
there, as the instruction-tuned checkpoints' generation configs do.  Gemma's has no tool syntax of
its own; the built-in one lists the request's tools in the first turn and writes calls and results
as Hermes does (``<tool_call>{...}</tool_call>`` in a model turn, ``<tool_response>`` in a user
turn), which the default ``--tool-call-parser`` reads.  Consecutive messages of one side share its
turn (two user messages, a developer message after the system prompt, results and the user's next
words; texts apart by a blank line) -- Gemma's own template refuses them, but the Responses and
Messages APIs and conversations send them --, and a conversation may begin with the model's turn
(the system prompt then a user turn of its own).  Without any template, chat requests get a 400
naming the problem.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- set system = (system + '\\n\\n' if system else '') + 'You can call these functions (JSON schemas):\\n'"
    " + (tools | map(attribute='function') | map('tojson') | join('\\n'))"
    " + '\\nTo call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}'"
    " + '</tool_call>, one per call.' -%}"
    "{%- endif -%}"
    "{%- set first_user_prefix = system + '\\n\\n' if system else '' -%}"
    "{%- if system and (not loop_messages or loop_messages[0]['role'] == 'assistant') -%}"
    "{{ '<start_of_turn>user\\n' + system + '<end_of_turn>\\n' }}"
    "{%- set first_user_prefix = '' -%}"
    "{%- endif -%}"
    "{%- set state = namespace(turn='', piece='') -%}"
    "{%- for message in loop_messages -%}"
    "{%- set turn = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{%- if turn != state.turn -%}"
    "{%- if state.turn -%}{{ '<end_of_turn>\\n' }}{%- endif -%}"
    "{{ '<start_of_turn>' + turn + '\\n' + (first_user_prefix if not state.turn else '') }}"
    "{%- elif state.piece == 'text' -%}"
    "{{ '\\n\\n' }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<tool_response>\\n' + message['content'] | trim + '\\n</tool_response>\\n' }}"
    "{%- set state.piece = 'tool' -%}"
    "{%- else -%}"
    "{{ message['content'] | trim }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' }}"
    "{%- endfor -%}"
    "{%- set state.piece = 'text' -%}"
    "{%- endif -%}"
    "{%- set state.turn = turn -%}"
    "{%- endfor -%}"
    "{%- if state.turn -%}{{ '<end_of_turn>\\n' }}{%- endif -%}"
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
