"""Prompt encoding off the event loop: small inputs inline, large ones in a thread, and inputs that
cannot fit the model refused from their size alone, before any tokenizer work."""
from __future__ import annotations

import asyncio
import threading

import pytest
from transformers import AutoTokenizer

from gateway.openai_protocol import OpenAIError
from gateway.prompts import PromptEncoder
from tests.support.checkpoints import write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_tokenizer(tmp_path_factory.mktemp("tok")))


class ThreadRecordingTokenizer:
    """The real tokenizer; records on which thread each encode ran."""

    def __init__(self, tok):
        self.tok = tok
        self.threads: list[str] = []

    def __call__(self, text, **kw):
        self.threads.append(threading.current_thread().name)
        return self.tok(text, **kw)

    def get_vocab(self):
        return self.tok.get_vocab()


async def test_large_inputs_are_tokenized_in_a_thread(tokenizer):
    recording = ThreadRecordingTokenizer(tokenizer)
    encoder = PromptEncoder(recording, max_model_len=100_000, inline_chars=100, threads=1)
    try:
        recording.threads.clear()  # the warm-up call
        short, long = "Hello world", "The quick brown fox jumps over the lazy dog. " * 50
        assert await encoder.text(short) == tokenizer(short).input_ids
        assert await encoder.text(long) == tokenizer(long).input_ids
        loop_thread = threading.current_thread().name
        assert recording.threads[0] == loop_thread
        assert recording.threads[1] != loop_thread and recording.threads[1].startswith("tokenize")
        # Chat templates too: rendering runs where the size says.
        where = []
        messages = [{"role": "user", "content": long}]
        ids = await encoder.chat(messages, lambda: where.append(threading.current_thread().name) or [1, 2])
        assert ids == [1, 2] and where[0].startswith("tokenize")
    finally:
        encoder.close()


async def test_an_input_too_large_for_the_model_is_refused_without_tokenizing(tokenizer):
    recording = ThreadRecordingTokenizer(tokenizer)
    encoder = PromptEncoder(recording, max_model_len=1024, inline_chars=100, threads=1)
    try:
        recording.threads.clear()
        huge = "x" * (1024 * encoder.max_token_bytes * PromptEncoder.SIZE_SLACK + 1)
        with pytest.raises(OpenAIError, match="maximum context length is 1024") as info:
            await encoder.text(huge)
        assert info.value.status == 400 and info.value.code == "context_length_exceeded"
        with pytest.raises(OpenAIError, match="maximum context length"):
            await encoder.chat([{"role": "user", "content": huge}], lambda: [1])
        assert recording.threads == []
        # The bound is a lower bound on tokens: anything that may fit is tokenized as usual.
        assert encoder.max_token_bytes >= max(len(t.encode()) for t in tokenizer.get_vocab())
        fits = "x" * 1024
        assert await encoder.text(fits) == tokenizer(fits).input_ids
    finally:
        encoder.close()


async def test_a_chat_template_that_runs_too_long_costs_its_request_a_400(tokenizer):
    """Every render runs in a thread within the time bound: a looping template fails its request
    and the event loop goes on (a short chat is rendered in a thread too)."""
    encoder = PromptEncoder(tokenizer, max_model_len=1024, threads=2, template_timeout_s=0.2)
    release = threading.Event()
    try:
        loop_thread = threading.current_thread().name
        where = []
        assert await encoder.chat([{"role": "user", "content": "hi"}],
                                  lambda: where.append(threading.current_thread().name) or [7]) == [7]
        assert where[0] != loop_thread
        with pytest.raises(OpenAIError, match="longer than 0.2 s") as info:
            await encoder.chat([{"role": "user", "content": "hi"}], lambda: release.wait(30) and [1])
        assert info.value.status == 400 and info.value.code == "chat_template_timeout"
        assert await encoder.text("still serving") == tokenizer("still serving").input_ids
    finally:
        release.set()
        encoder.close()


async def test_a_render_waiting_for_a_thread_is_not_timed_until_it_runs(tokenizer):
    """The time bound is the render's own: a chat queued behind a render that holds the only thread
    for twice the bound is rendered, not refused."""
    bound = 0.5
    encoder = PromptEncoder(tokenizer, max_model_len=1024, threads=1, template_timeout_s=bound)
    release = threading.Event()
    try:
        holder = asyncio.ensure_future(encoder.chat([{"role": "user", "content": "a"}], lambda: release.wait(30) and [1]))
        queued = asyncio.ensure_future(encoder.chat([{"role": "user", "content": "b"}], lambda: [2]))
        with pytest.raises(OpenAIError, match="chat_template|longer than"):
            await holder  # the holder's own render timed out; its thread is still held
        await asyncio.sleep(bound)  # the queued one has now waited twice the bound
        assert not queued.done()
        release.set()
        assert await queued == [2]
    finally:
        release.set()
        encoder.close()


async def test_a_long_token_list_is_detokenized_off_the_event_loop(tokenizer):
    class Recording:
        def __init__(self):
            self.threads = []

        def decode(self, ids):
            self.threads.append(threading.current_thread().name)
            return tokenizer.decode(ids)

        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    recording = Recording()
    encoder = PromptEncoder(recording, max_model_len=1024, inline_chars=16, threads=1)
    try:
        short, long = [5] * 16, [5] * 17
        assert await encoder.detokenize(short) == tokenizer.decode(short)
        assert await encoder.detokenize(long) == tokenizer.decode(long)
        assert recording.threads[0] == threading.current_thread().name
        assert recording.threads[1].startswith("tokenize")
    finally:
        encoder.close()
