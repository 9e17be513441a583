"""The requests of a chaos run (``benchmarks/chaos_scenario.py``): what each client sends, and how
it ended.

``Planner`` draws request specs from a seed -- prompt lengths log-uniform in the config's range,
some sharing long prefixes, greedy or sampled, streamed or not, a few hostile sampling values, a few
planned disconnects (before the first token, while a long prompt's KV moves, mid-decode).
``run_request`` sends one with the official ``openai`` client and classifies how it ended:
completed, an explicit error (its status and Retry-After kept, for ``chaos_checks.classify_error``),
disconnected on purpose, a hang (no end within the bound) or broken (no answer and no error, or a
wrong-length answer).
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import openai


# ---- the requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.  ``requests`` per round; rounds repeat until ``minutes`` have passed (0: one round)."""

    transport: str = "tcp"
    requests: int = 300
    minutes: float = 0.0
    concurrency: int = 12
    seed: int = 0
    min_prompt: int = 8
    max_prompt: int = 1500
    max_tokens: int = 24
    faults: tuple[str, ...] = ("hostile", "kill_prefill", "kill_decode", "restart_redis", "garbage_kv")
    request_bound_s: float = 120.0  # a request that has not ended by then is a hang
    block_size: int = 16
    decode_blocks: int = 112  # 1792 tokens: one long prompt nearly fills a decode worker
    prefill_blocks: int = 112
    settle_timeout_s: float = 120.0  # for the stack to be back to idle after the load
    idle_cpu_window_s: float = 5.0

    @property
    def kv_backstop_s(self) -> float:
        """The workers' ``--kv-timeout`` and ``--kv-lease-timeout``: longer than the whole run, its
        settling included.  A reservation's lease (the KV timeout and then some) or a prefill
        worker's wait for an acknowledgement can then never end before the leak check, so whatever
        only such a backstop would free is still held there.  (Chaos injects no hung peer: a
        killed one is noticed through its connections.)"""
        return 3600.0 + self.minutes * 60


@dataclass
class Spec:
    """One planned request."""

    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    stream: bool
    top_p: float = 1.0
    seed: int | None = None
    extra: dict = field(default_factory=dict)  # hostile fields (huge top_k)
    disconnect: str | None = None  # "before_first" | "during_transfer" | "mid_decode"
    cancel_after_s: float | None = None
    after_chunks: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def kind(self) -> str:
        if self.temperature and self.greedy:
            return "tiny_temperature"
        if self.extra:
            return "huge_top_k"
        return ("greedy" if self.greedy else "sampled") + ("_stream" if self.stream else "")


@dataclass
class Outcome:
    spec: Spec
    kind: str  # completed | error | disconnected | hang | broken
    text: str = ""
    detail: str = ""
    status: int | None = None  # the HTTP status of an error answer (None: an error event in a stream)
    retry_after: str | None = None  # its Retry-After header
    seconds: float = 0.0
    ended_at: float = field(default_factory=time.monotonic)


class Planner:
    """Random request specs from a seed: a mix of lengths, modes and planned disconnects."""

    def __init__(self, config: ChaosConfig, vocab: int):
        self.config = config
        self.rng = random.Random(config.seed)
        self.vocab = vocab
        self.count = 0
        # Long shared prefixes: prefix-cache hits on both pools, so only the missing blocks move.
        self.prefixes = [self._ids(self.rng.randint(64, 600)) for _ in range(4)]

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _length(self) -> int:
        c = self.config
        return int(round(math.exp(self.rng.uniform(math.log(c.min_prompt), math.log(c.max_prompt)))))

    def next(self) -> Spec:
        rng, c = self.rng, self.config
        n = self._length()
        if rng.random() < 0.35:
            prefix = rng.choice(self.prefixes)
            prompt = (prefix + self._ids(max(1, n - len(prefix))))[: max(n, len(prefix) + 1)]
        else:
            prompt = self._ids(n)
        prompt = prompt[: c.max_prompt]
        spec = Spec(self.count, prompt, max_tokens=rng.randint(1, c.max_tokens), temperature=0.0,
                    stream=rng.random() < 0.5)
        self.count += 1
        roll = rng.random()
        if roll < 0.35:
            spec.temperature, spec.top_p = rng.uniform(0.6, 1.3), rng.choice([1.0, 0.9])
            spec.seed = rng.choice([None, rng.randrange(1 << 30)])
        elif roll < 0.38:
            spec.temperature = 1e-40  # hostile: must mean greedy, not inf/NaN logits
        elif roll < 0.41:
            spec.temperature, spec.extra = 0.8, {"top_k": 2 ** 70}  # hostile: bounded by the vocabulary
        roll = rng.random()
        if roll < 0.05:
            spec.disconnect, spec.cancel_after_s = "before_first", rng.uniform(0.0, 0.05)
        elif roll < 0.10 and len(prompt) >= 300:
            spec.disconnect, spec.cancel_after_s = "during_transfer", rng.uniform(0.05, 1.0)
        elif roll < 0.15 and spec.max_tokens >= 4:
            spec.disconnect, spec.stream = "mid_decode", True
            spec.after_chunks = rng.randint(1, spec.max_tokens - 2)
        return spec


async def run_request(client: openai.AsyncOpenAI, model: str, spec: Spec, bound_s: float,
                      on_chunk: Callable[[], None] = lambda: None) -> Outcome:
    """Send one request as a client would; classify how it ended.  ``on_chunk``: called for each
    streamed chunk that carries text."""
    kwargs = dict(model=model, prompt=spec.prompt, max_tokens=spec.max_tokens, temperature=spec.temperature,
                  top_p=spec.top_p, stream=spec.stream, extra_body={"ignore_eos": True, **spec.extra})
    if spec.seed is not None:
        kwargs["seed"] = spec.seed
    if spec.stream:
        kwargs["stream_options"] = {"include_usage": True}
    pieces: list[str] = []
    began = time.monotonic()

    def outcome(kind: str, **kw) -> Outcome:
        return Outcome(spec, kind, text="".join(pieces), seconds=time.monotonic() - began, **kw)

    async def send() -> Outcome:
        if not spec.stream:
            r = await client.completions.create(**kwargs)
            pieces.append(r.choices[0].text)
            return judge_complete(r.choices[0].finish_reason, r.usage.completion_tokens)
        stream = await client.completions.create(**kwargs)
        finish, tokens, chunks = None, None, 0
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                chunks += 1
                on_chunk()
                if spec.disconnect == "mid_decode" and chunks >= spec.after_chunks and finish is None:
                    return outcome("disconnected", detail="mid_decode")
        finally:
            await stream.close()
        return judge_complete(finish, tokens)

    def judge_complete(finish, tokens) -> Outcome:
        if finish == "length" and tokens == spec.max_tokens:
            return outcome("completed")
        return outcome("broken", detail=f"ended with finish_reason={finish}, {tokens} tokens of {spec.max_tokens}")

    task = asyncio.ensure_future(send())
    try:
        if spec.cancel_after_s is not None:
            done, _ = await asyncio.wait({task}, timeout=spec.cancel_after_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return outcome("disconnected", detail=spec.disconnect)
        async with asyncio.timeout(max(0.0, bound_s - (time.monotonic() - began))):
            return await asyncio.shield(task)
    except TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return outcome("hang", detail=f"no end within {bound_s:g} s")
    except openai.APIStatusError as exc:
        return outcome("error", status=exc.status_code, detail=str(exc.message)[:300],
                       retry_after=exc.response.headers.get("retry-after"))
    except openai.APIConnectionError as exc:
        return outcome("broken", detail=f"connection lost without an error: {exc!r}"[:300])
    except openai.APIError as exc:  # an error event in a started stream
        return outcome("error", detail=str(exc.message)[:300])
    except Exception as exc:  # noqa: BLE001 - anything else is a broken answer, reported
        return outcome("broken", detail=f"{type(exc).__name__}: {exc}"[:300])
