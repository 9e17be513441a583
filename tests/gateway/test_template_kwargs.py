"""``chat_template_kwargs`` read within bounds (gateway/template_kwargs.py), and the chat fields that
shape the template's rendering."""
from __future__ import annotations

import json

import msgspec
import pytest

from gateway.openai_protocol import OpenAIError, parse_chat_request
from gateway.template_kwargs import (
    MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_KWARGS_BYTES, check_not_parameters, read_template_kwargs,
)


def read(value) -> dict:
    return read_template_kwargs(msgspec.Raw(json.dumps(value).encode()))


def refused(value, text: str) -> None:
    with pytest.raises(OpenAIError) as info:
        read(value)
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs") and text in info.value.message


def test_variables_are_read():
    assert read({"enable_thinking": False, "persona": {"name": "x"}}) == {"enable_thinking": False,
                                                                          "persona": {"name": "x"}}


@pytest.mark.parametrize("name", ["chat_template", "messages", "tools", "add_generation_prompt", "bos_token",
                                  "sanitize_control_tokens", "raise_exception", "namespace"])
def test_the_names_of_parameters_special_tokens_and_functions_are_refused(name):
    refused({name: "x", "ok": 1}, name)


def test_size_and_count_are_bounded():
    refused({"big": "x" * MAX_TEMPLATE_KWARGS_BYTES}, "bytes of JSON")
    refused({f"v{i}": 0 for i in range(MAX_TEMPLATE_KWARGS + 1)}, f"at most {MAX_TEMPLATE_KWARGS} variables")
    refused([1, 2], "Expected `object`")


def test_the_installed_renderers_own_parameters_are_refused_too():
    def apply_chat_template(conversation, future_option=None, **kwargs):
        return ""

    check_not_parameters({"ok": 1}, apply_chat_template)
    with pytest.raises(OpenAIError) as info:
        check_not_parameters({"future_option": 1}, apply_chat_template)
    assert info.value.param == "chat_template_kwargs"


def test_continuing_a_message_of_tool_calls_is_refused():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"model": "m", "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "content": None, "tool_calls": [call]}]}
    with pytest.raises(OpenAIError) as info:
        parse_chat_request(json.dumps(body).encode())
    assert info.value.param == "continue_final_message"
    body["messages"][-1] = {"role": "assistant", "content": "The answer is"}
    assert parse_chat_request(json.dumps(body).encode()).continue_final_message is True


def test_metadata_of_sixteen_long_pairs_escaped_is_accepted():
    """Each character outside the BMP escaped as a surrogate pair (Python's json.dumps): 12 bytes."""
    metadata = {f"{i:02d}" + "🙂" * 62: "🙂" * 512 for i in range(16)}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": metadata})
    assert parse_chat_request(body.encode()).metadata == metadata
