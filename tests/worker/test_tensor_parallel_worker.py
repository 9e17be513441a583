"""Tensor-parallel workers served through a real gateway and Redis: a TP=2 prefill worker and a TP=2
decode worker next to a one-rank decode worker.  Greedy answers equal the one-rank engine's, and a
follower rank killed while its worker streams fails that whole worker (its stream ends with an
error, it leaves the pool, it exits non-zero) while the stack keeps serving."""
from __future__ import annotations

import asyncio
import signal
import time

import openai
import psutil
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.cluster import running_cluster
from tests.support.scripted_peer import Stream, WorkerClient

pytestmark = pytest.mark.slow(seconds=8)  # a long file: scheduled by its length (tests/conftest.py)

PROMPTS = ["The quick brown fox", "KV cache blocks move from the prefill worker", "Tensor parallel ranks"]


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    """p0 prefills with two ranks; d0 decodes with two ranks, d1 with one."""
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("tp-logs"), redis_url, prefill=0, decode=0,
                         worker_args=["--num-blocks", "128", "--block-size", "4", "--no-compile"]) as c:
        for name, role, tp in [("p0", "prefill", "2"), ("d0", "decode", "2"), ("d1", "decode", "1")]:
            c.role_args[role] = ["--tensor-parallel-size", tp]
            c.start_worker(name, role)
        assert c.wait_for_workers(prefill=1, decode=2, timeout=180)
        yield c


def client_of(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=120)


def test_greedy_answers_equal_one_rank(stack, served_checkpoint):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=4))
    for prompt in PROMPTS:
        served = client_of(stack).completions.create(model=stack.model_name, prompt=prompt, max_tokens=12,
                                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        assert served == engine.generate([prompt], {"max_tokens": 12, "temperature": 0, "ignore_eos": True})[0].text
    assert stack.stats("d0")["tensor_parallel_size"] == 2 and stack.stats("p0")["tensor_parallel_size"] == 2


def test_a_tensor_parallel_worker_listens_on_loopback_alone(stack):
    """Its ranks meet through a private file, and their group's sockets are on loopback: the
    rendezvous was torch's TCPStore, listening on every interface for anyone to rewrite the ranks'
    addresses (the workers' own listeners here are on 127.0.0.1, as configured)."""
    for name in ("d0", "p0"):
        worker = psutil.Process(stack.procs[name].popen.pid)
        listening = [c.laddr for p in [worker, *worker.children(recursive=True)]
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(address.ip in ("127.0.0.1", "::1") for address in listening), (name, listening)


async def stream_while_a_follower_dies(stack) -> list:
    """A long stream on d0; once it has tokens, d0's follower rank is killed.  Its frames."""
    async with WorkerClient(stack, "d0") as client:
        stream = Stream(client, list(range(10, 30)), prefill_worker_id="p0", max_tokens=2000)
        await asyncio.wait_for(stream.first.wait(), 120)
        worker = psutil.Process(stack.procs["d0"].popen.pid)
        followers = [p for p in worker.children(recursive=True)
                     if any("spawn_main" in part for part in p.cmdline())]  # not multiprocessing's resource tracker
        assert followers, "the worker runs its follower rank as a child process"
        followers[0].send_signal(signal.SIGKILL)
        try:
            return await asyncio.wait_for(stream.task, 120)
        except Exception:  # the connection may end without a last frame when the worker exits
            return stream.frames


def test_a_dead_follower_fails_the_whole_worker_and_the_stack_keeps_serving(stack):
    frames = asyncio.run(stream_while_a_follower_dies(stack))
    assert not (frames[-1].finished and frames[-1].error is None), "the stream ended as if complete"
    assert sum(len(f.token_ids) for f in frames) < 2000
    deadline = time.monotonic() + 120
    while stack.procs["d0"].popen.poll() is None:
        assert time.monotonic() < deadline, "the worker did not fail when its follower rank died"
        time.sleep(0.1)
    assert stack.procs["d0"].popen.returncode != 0
    for prompt in PROMPTS:  # the gateway routes around it: d1 answers
        answer = client_of(stack).completions.create(model=stack.model_name, prompt=prompt, max_tokens=4,
                                                     extra_body={"ignore_eos": True})  # sampled: EOS may come
        assert answer.choices[0].finish_reason == "length"
