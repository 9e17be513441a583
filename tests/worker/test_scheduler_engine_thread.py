"""The scheduler's livelock seen from the engine thread (issue 27): a chunked prompt that cannot
fit beside a reservation used to compute a chunk, preempt itself and start again, step after step:
the thread never slept and the prompt queued behind it never ran.  Now the prompt behind it runs,
then the thread sleeps until the reservation lets go, and then the long prompt runs too."""
import asyncio
import time

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from worker.engine_thread import EngineThread
from tests.support.checkpoints import tiny_llama_config, write_checkpoint

WAIT = 120.0  # generous bound on anything awaited
PARAMS = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The engine thread computes next to the event loop in this process: on a shared 2-core host
    more torch threads only fight over the cores (and the GIL)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tiny_llama_config(max_position_embeddings=128), tmp_path_factory.mktemp("llama"))


async def finish(thread: EngineThread, rid: str, prompt: list[int]) -> list[int]:
    """Run one request through the thread; returns its tokens or raises what ended it."""
    stream = thread.open_stream(rid)
    try:
        await thread.call(lambda e: e.add_request(prompt, PARAMS, rid))
        tokens = []
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                raise item
            tokens += item.new_token_ids
            if item.finished:
                return tokens
    finally:
        thread.close_stream(rid)


async def test_a_prompt_that_cannot_fit_beside_a_reservation_lets_the_thread_sleep(checkpoint):
    # 8 blocks of 4 tokens, 3 tokens a step: the 20-token prompt is computed in chunks.
    engine = Engine(EngineConfig(model=str(checkpoint), block_size=4, num_blocks=8, max_num_batched_tokens=3,
                                 remote_kv_budget=0.5), load_tokenizer=False)
    thread = EngineThread(engine, asyncio.get_running_loop())
    thread.start()
    try:
        def reserve(e):
            return e.scheduler.reserve_remote(e.make_request(list(range(100, 116)), PARAMS, "remote"), lease_s=3600)

        assert await thread.call(reserve) is not None  # 4 of the 8 blocks, until its lease ends
        long = asyncio.ensure_future(finish(thread, "long", list(range(10, 30))))  # needs 5 blocks
        try:
            short = await asyncio.wait_for(finish(thread, "short", [50, 51, 52, 53]), WAIT)
        except asyncio.TimeoutError:
            pytest.fail(f"the 4-token prompt never ran: {thread.steps} steps, "
                        f"{thread.snapshot.get('num_preemptions')} preemptions")
        assert len(short) == PARAMS["max_tokens"]
        steps = thread.steps
        time.sleep(0.3)  # the event loop stays away: whatever the thread does now, it does alone
        assert thread.steps - steps <= 1, f"{thread.steps - steps} steps while nothing could make progress"
        assert not long.done()
        stats = await thread.call(lambda e: e.stats())
        assert stats["num_preemptions"] == 0, "the long prompt was admitted although it could not fit"
        # The lease ends: the thread wakes by itself, frees the reservation and runs the long prompt.
        await thread.call(lambda e: e.scheduler.handoff.decode.leases.update(remote=time.monotonic() + 0.2))
        assert len(await asyncio.wait_for(long, WAIT)) == PARAMS["max_tokens"]
        await thread.call(lambda e: e.scheduler.check_integrity())
    finally:
        thread.stop()
