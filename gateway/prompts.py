"""Request inputs to prompt token ids, without ever blocking the gateway's event loop.

    body size ok (413 otherwise) -> admission (429) -> size check (400, from the byte length alone)
        -> small input: tokenize inline          (cheaper than a thread hop)
        -> large input: tokenize in a thread     (a 4 MiB prompt or a long chat template takes
                                                  seconds; the loop keeps serving other streams)

The size check needs no tokenizer: no token is longer than ``max_token_bytes`` (the longest
vocabulary entry, in UTF-8), so an input of ``n`` bytes has at least ``n / max_token_bytes``
tokens.  An input that cannot fit the model even so is refused before any tokenizer work.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
from typing import Any, Callable, Sequence

from gateway.openai_protocol import invalid


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 length of the text any one token stands for."""
    vocab = tokenizer.get_vocab()
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1)
    return max(1, longest)


DEFAULT_TEMPLATE_TIMEOUT_S = 5.0


class PromptEncoder:
    """Prompt text and chat messages to token ids (see the module docstring).

    ``tokenizer`` is a Hugging Face tokenizer; ``inline_chars``: inputs up to this many characters
    are tokenized on the calling thread; ``threads``: size of the pool for the rest.
    """

    # Slack on the size bound: normalizers may drop characters, templates add a few tokens.
    SIZE_SLACK = 2

    def __init__(self, tokenizer: Any, max_model_len: int, *, inline_chars: int = 4096, threads: int = 2,
                 template_timeout_s: float = DEFAULT_TEMPLATE_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.inline_chars = inline_chars
        self.template_timeout_s = template_timeout_s
        self.max_token_bytes = max_token_bytes(tokenizer)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        # The first call may adjust the Rust tokenizer's settings (truncation, padding); do it now,
        # before threads can race on it.
        tokenizer("warm up")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_size(self, num_chars: int, num_bytes: int, param: str) -> None:
        """Refuse an input whose byte length alone proves it longer than the model's context."""
        at_least = math.ceil(num_bytes / (self.max_token_bytes * self.SIZE_SLACK))
        if at_least > self.max_model_len:
            raise invalid(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your input of "
                f"{num_chars} characters is at least {at_least} tokens. Please reduce the prompt.", param,
                "context_length_exceeded")

    async def text(self, text: str, add_special_tokens: bool = True, bounded: bool = True) -> list[int]:
        """``text``'s tokens; ``bounded``: a text too long for the context by its size alone is refused
        first (not one to be truncated: the request body's bound is its bound)."""
        if bounded:
            self.check_size(len(text), len(text.encode("utf-8", "surrogatepass")), "prompt")
        return await self._run(len(text), lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids))

    async def chat(self, messages: Sequence[dict[str, str]], render: Callable[[], list[int]],
                   bounded: bool = True) -> list[int]:
        """``render()`` applies the chat template and tokenizes, always in a thread and within
        ``template_timeout_s`` from when a thread takes it (not while it waits for one behind other
        renders): a template is a program (jinja2's sandbox bounds what it may touch, not how long
        it runs), and one that loops must cost its request a 400, not the event loop.
        (The thread it holds is freed when the render ends.)  ``bounded``: as ``text``'s."""
        if bounded:
            chars = sum(len(m["content"]) for m in messages)
            self.check_size(chars, sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages),
                            "messages")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as deadline:  # set once a thread takes the render, not queued
                def start() -> None:
                    with contextlib.suppress(RuntimeError):  # (the wait already ended: cancelled)
                        deadline.reschedule(loop.time() + self.template_timeout_s)

                def rendered() -> list[int]:
                    loop.call_soon_threadsafe(start)  # (runs before the result's own callback)
                    return render()

                return await loop.run_in_executor(self._pool, rendered)
        except TimeoutError:
            raise invalid(f"the chat template took longer than {self.template_timeout_s:g} s to render these "
                          "messages", "messages", "chat_template_timeout") from None

    async def detokenize(self, ids: list[int]) -> str:
        """``ids``' text (special tokens kept, as vLLM's ``/detokenize``): a long list in a thread."""
        return await self._run(len(ids), lambda: self.tokenizer.decode(ids))

    async def _run(self, size: int, work: Callable[[], Any]) -> Any:
        if size <= self.inline_chars:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)
