"""Chat templates for checkpoints without one: --chat-template (file or inline) and Gemma's built-in
turn format, through a real gateway and decode worker on a tiny Gemma 3 checkpoint with no template."""
from __future__ import annotations

import time

import openai
import pytest
from transformers import AutoTokenizer

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from gateway.chat_template import GEMMA_TURNS, load_chat_template, resolve_chat_format
from tests.support.checkpoints import CHAT_TEMPLATE, tiny_gemma3_config, write_checkpoint, write_tokenizer
from tests.support.cluster import running_cluster

GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
INLINE = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma") / "tinygemma"
    write_checkpoint(tiny_gemma3_config(), directory)
    write_tokenizer(directory, chat_template=None)  # like the default model's GGUF: no template
    return directory


@pytest.fixture(scope="module")
def tokenizer(gemma_dir):
    return AutoTokenizer.from_pretrained(gemma_dir)


# ---- choosing the template ----------------------------------------------------------------------


def test_the_template_comes_from_the_flag_then_the_checkpoint_then_the_builtin_format(tokenizer, tmp_path):
    assert not tokenizer.chat_template
    gemma = resolve_chat_format(tokenizer, "gemma3_text")
    assert gemma.template == GEMMA_TURNS and "gemma3_text" in gemma.source
    assert resolve_chat_format(tokenizer, "llama").template is None  # no template, no built-in: chat refused
    inline = resolve_chat_format(tokenizer, "gemma3_text", INLINE)
    assert inline.template == INLINE and inline.source == "--chat-template" and inline.stop_token_ids == ()
    path = tmp_path / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    assert load_chat_template(str(path)) == CHAT_TEMPLATE
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not render"):
        resolve_chat_format(tokenizer, "llama", "{% for m in messages %}")


def test_gemma_turn_format_and_its_end_of_turn_stop_token(gemma_dir):
    tok = AutoTokenizer.from_pretrained(gemma_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    chat = resolve_chat_format(tok, "gemma3")
    assert chat.stop_token_ids == (tok.convert_tokens_to_ids("<end_of_turn>"),)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]
    text = tok.apply_chat_template(messages, chat_template=chat.template, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                    "<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")



@pytest.mark.parametrize("messages, expected", [
    # Consecutive messages of one side share its turn (Gemma's own template refuses them; the
    # Responses and Messages APIs and conversations send them).
    ([{"role": "user", "content": "Hi, I am Bob"}, {"role": "user", "content": "What is my name?"}],
     "<start_of_turn>user\nHi, I am Bob\n\nWhat is my name?<end_of_turn>\n"),
    ([{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Say yes."},
      {"role": "user", "content": "Ok?"}],
     "<start_of_turn>user\nBe brief.\n\nSay yes.\n\nOk?<end_of_turn>\n"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\nb\n\nc<end_of_turn>\n"),
    # A conversation may begin with the model's turn; a system prompt then has a user turn of its own.
    ([{"role": "assistant", "content": "Hello!"}], "<start_of_turn>model\nHello!<end_of_turn>\n"),
    ([{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hello!"}],
     "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"),
])
def test_gemma_turn_format_joins_consecutive_messages_of_one_side(tokenizer, messages, expected):
    text = tokenizer.apply_chat_template(messages, chat_template=GEMMA_TURNS, add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<bos>" + expected + "<start_of_turn>model\n"


def test_gemma_turn_format_with_tools_calls_and_results(gemma_dir):
    """The built-in format lists the tools in the first turn, writes an assistant's calls as the
    default tool-call parser (hermes) reads them, and puts consecutive results in one user turn."""
    from gateway.tool_parsers import HermesParser

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    calls = [{"id": "1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}},
             {"id": "2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "1", "content": "12:00"},
                {"role": "tool", "tool_call_id": "2", "content": "13:00"}]
    text = tok.apply_chat_template(messages, tools=tools, chat_template=GEMMA_TURNS, add_generation_prompt=True,
                                   tokenize=False)
    first, model, results, prompt = text.split("<start_of_turn>")[1:]
    assert first.startswith("user\nYou can call these functions") and '"name": "get_time"' in first
    assert first.endswith("time?<end_of_turn>\n")
    _, parsed = HermesParser().parse(model[len("model\n"):-len("<end_of_turn>\n")], frozenset({"get_time"}))
    assert [(c.name, c.arguments) for c in parsed] == [("get_time", '{"zone": "utc"}'), ("get_time", "{}")]
    assert results == ("user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n"
                       "</tool_response>\n<end_of_turn>\n")
    assert prompt == "model\n"
    # The user's next words after the results share their turn.
    text = tok.apply_chat_template([*messages, {"role": "user", "content": "and now?"}], tools=tools,
                                   chat_template=GEMMA_TURNS, tokenize=False)
    assert text.endswith("<tool_response>\n13:00\n</tool_response>\nand now?<end_of_turn>\n")


# ---- served -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(gemma_dir, redis_url, tmp_path_factory):
    with running_cluster(gemma_dir, tmp_path_factory.mktemp("logs"), redis_url, prefill=0, decode=1,
                         worker_args=["--num-blocks", "256", "--block-size", "4"]) as c:
        yield c


def test_chat_works_out_of_the_box_on_a_gemma_checkpoint_without_a_template(stack, gemma_dir, tokenizer):
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Hello world!"}]
    response = client.chat.completions.create(model=stack.model_name, messages=messages, **GREEDY)
    expected_ids = tokenizer("<bos><start_of_turn>user\nHello world!<end_of_turn>\n<start_of_turn>model\n",
                             add_special_tokens=False).input_ids
    assert response.usage.prompt_tokens == len(expected_ids)
    engine = Engine(EngineConfig(model=str(gemma_dir), num_blocks=64, block_size=4))
    offline = engine.generate([expected_ids], {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0]
    assert response.choices[0].message.content == offline.text


def test_a_conversations_turns_reach_a_gemma_checkpoint_as_its_turns(stack, tokenizer):
    """A conversation whose items end with the user's (as clients add them) answered with more of
    the user's input: two user messages in a row, one Gemma user turn."""
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0)
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "I am Bob"}])
    response = client.responses.create(model=stack.model_name, input="Who am I?", conversation=conversation.id,
                                       temperature=0, max_output_tokens=4)
    expected = tokenizer("<bos><start_of_turn>user\nI am Bob\n\nWho am I?<end_of_turn>\n<start_of_turn>model\n",
                         add_special_tokens=False).input_ids
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens == len(expected)


def test_an_inline_chat_template_from_the_flag(stack, tokenizer):
    proc = stack.start_gateway("inline", ["--chat-template", INLINE])
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 120
        while True:  # until it has started and sees the decode worker
            try:
                response = client.chat.completions.create(
                    model=stack.model_name, messages=[{"role": "user", "content": "Hello world!"}], **GREEDY)
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                assert proc.popen.poll() is None and time.monotonic() < deadline, proc.log()
                time.sleep(0.1)
        expected = tokenizer("[user: Hello world!]", add_special_tokens=False).input_ids
        assert response.usage.prompt_tokens == len(expected)
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)
