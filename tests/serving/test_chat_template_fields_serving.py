"""vLLM's chat-template fields on a served chat request: ``chat_template_kwargs`` reach the template
(a gateway whose template reads one), ``continue_final_message`` goes on from the last message
(greedy, equal to a completion of the template's rendering left open; the generation prompt then left
out), ``add_generation_prompt``
false leaves the prompt out, and ``/tokenize`` renders a chat body as the chat request does."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.support.checkpoints import CHAT_TEMPLATE
from tests.support.cluster import extra_gateway

pytestmark = pytest.mark.slow(seconds=8)

# The test checkpoint's template, and a greeting variable before the conversation.
TEMPLATE = "{{ greeting | default('') }}" + CHAT_TEMPLATE
TURNS = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def gateway(stack):
    with extra_gateway(stack, "template-fields", ["--chat-template", TEMPLATE]) as proc:
        yield proc


def tokens(gateway, **body) -> list[int]:
    req = urllib.request.Request(f"{gateway.url}/tokenize", json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)["tokens"]


def test_template_kwargs_reach_the_template(stack, gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
    plain = client.chat.completions.create(model=stack.model_name, messages=TURNS[:1], max_tokens=2)
    greeted = client.chat.completions.create(model=stack.model_name, messages=TURNS[:1], max_tokens=2,
                                             extra_body={"chat_template_kwargs": {"greeting": "Ahoy there, sailor!"}})
    added = tokens(gateway, model=stack.model_name, prompt="Ahoy there, sailor!", add_special_tokens=False)
    assert greeted.usage.prompt_tokens - plain.usage.prompt_tokens == len(added)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=stack.model_name, messages=TURNS[:1], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert info.value.body["param"] == "chat_template_kwargs"


def test_continue_final_message_goes_on_from_the_last_message(client, stack, gateway):
    from transformers import AutoTokenizer

    answer = client.chat.completions.create(model=stack.model_name, messages=TURNS, max_tokens=12, temperature=0,
                                            extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                        "ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(stack.checkpoint)
    ids = tokenizer(tokenizer.apply_chat_template(TURNS, continue_final_message=True, tokenize=False),
                    add_special_tokens=False).input_ids
    expected = client.completions.create(model=stack.model_name, prompt=ids, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == expected.choices[0].text
    assert answer.usage.prompt_tokens == len(ids)
    opened = tokens(gateway, model=stack.model_name, messages=TURNS, continue_final_message=True,
                    add_generation_prompt=False)
    greeted = tokens(gateway, model=stack.model_name, messages=TURNS, continue_final_message=True,
                     add_generation_prompt=False, chat_template_kwargs={"greeting": "Ahoy"})
    assert len(greeted) > len(opened)
    # (the generation prompt is left out with it, whatever add_generation_prompt says, as it must be)
    assert tokens(gateway, model=stack.model_name, messages=TURNS, continue_final_message=True) == opened


def test_no_generation_prompt_leaves_it_out(client, stack):
    with_prompt = client.chat.completions.create(model=stack.model_name, messages=TURNS[:1], max_tokens=1)
    without = client.chat.completions.create(model=stack.model_name, messages=TURNS[:1], max_tokens=1,
                                             extra_body={"add_generation_prompt": False})
    assert with_prompt.usage.prompt_tokens > without.usage.prompt_tokens
