"""A long prompt is served under steady load (the chaos run's starvation of large KV reservations).

A decode worker with a small pool serves a closed loop of short prompts, more than it holds at
once; a prompt needing most of the pool arrives meanwhile.  Short prompts could take the room each
time it frees; with first-come-first-served reservations (``Scheduler.claim``, and the gateway's
queue keeping a waiting request's place) the long one gets its turn: it completes, its greedy
output equal to the offline engine's, instead of 503 after the gateway's queue timeout.  The exact
interleavings that starved it are pinned down in tests/test_scheduler_liveness.py and
tests/test_backpressure.py; this is the real stack doing it."""
from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.cluster import running_cluster

BLOCK = 16
DECODE_BLOCKS = 24  # the long prompt needs 15 of them; reservations may take the whole pool
# More short requests than the pool holds at once (4-5 blocks each), ending at different steps: some
# always wait in the gateway's queue, and the room a finished one frees is never most of the pool.
SHORT_CLIENTS = 8
LONG_WORDS = " ".join(f"w{i % 97}x{i % 13}" for i in range(400))


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("fairness"), redis_url, prefill=1, decode=1,
                         worker_args=["--block-size", str(BLOCK), "--dtype", "float32"],
                         role_args={"decode": ["--num-blocks", str(DECODE_BLOCKS), "--remote-kv-budget", "1.0"],
                                    "prefill": ["--num-blocks", "128"]},
                         gateway_args=["--skip-prefill-below", "8", "--queue-timeout", "20"]) as c:
        yield c


def test_a_long_prompt_is_served_while_short_ones_keep_coming(stack, served_checkpoint):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=128, block_size=BLOCK, dtype="float32"))
    ids = engine.tokenizer(LONG_WORDS).input_ids
    long_ids = ids[: BLOCK * 15 - 8]  # 15 blocks: more than the budget, most of the pool
    expected = engine.generate([long_ids], {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0].text
    short_done: list[int] = []
    long_result: dict = {}

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)
        stop = asyncio.Event()

        async def shorts(k):
            n = 0
            while not stop.is_set():
                n += 1
                prompt = [3 + (k * 1000 + n * 7 + i) % 500 for i in range(56)]  # distinct: no prefix hits
                await client.completions.create(model=stack.model_name, prompt=prompt,
                                                max_tokens=4 + (k * 5 + n * 3) % 20, temperature=0,
                                                extra_body={"ignore_eos": True})
                short_done.append(k)

        try:
            loops = [asyncio.create_task(shorts(k)) for k in range(SHORT_CLIENTS)]
            while len(short_done) < SHORT_CLIENTS:  # steady state: the pool is busy
                await asyncio.sleep(0.1)
                assert not any(t.done() for t in loops), [t.exception() for t in loops if t.done()]
            before = len(short_done)
            try:
                response = await client.completions.create(model=stack.model_name, prompt=long_ids, max_tokens=8,
                                                           temperature=0, extra_body={"ignore_eos": True})
                long_result["text"] = response.choices[0].text
            except openai.APIStatusError as exc:
                long_result["error"] = f"{exc.status_code} {exc.message}"
            long_result["shorts_meanwhile"] = len(short_done) - before
            stop.set()
            await asyncio.gather(*loops)  # every short request was served too
        finally:
            stop.set()
            await client.close()

    asyncio.run(main())
    assert long_result.get("text") == expected, long_result
    # The load was real: short requests were served while the long one waited for its room.
    assert long_result["shorts_meanwhile"] > 0, long_result
    # Some request was refused for room (the contention this test is about) and still got its turn.
    with urllib.request.urlopen(f"{stack.gateway_url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    busy = [line for line in metrics.splitlines() if line.startswith("pdserve_decode_busy_total{")]
    assert busy and sum(float(line.rsplit(" ", 1)[1]) for line in busy) > 0, busy
