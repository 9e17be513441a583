"""A decode worker with ``--tensor-parallel-size 2`` served through a real gateway and Redis: its
greedy answers equal the one-rank engine's, it takes no prefill requests, and a follower rank that
dies fails the whole worker (it leaves the pool and exits non-zero) instead of hanging it."""
from __future__ import annotations

import json
import signal
import time
import urllib.error

import openai
import psutil
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.cluster import running_cluster

PROMPTS = ["The quick brown fox", "KV cache blocks move from the prefill worker"]


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("tp-logs"), redis_url, prefill=0, decode=1,
                         worker_args=["--num-blocks", "128", "--block-size", "4", "--tensor-parallel-size", "2",
                                      "--no-compile"]) as c:
        assert c.wait_for_workers(prefill=0, decode=1, timeout=180)
        yield c


def test_greedy_answers_equal_one_rank(stack, served_checkpoint):
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=120)
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=4))
    for prompt in PROMPTS:
        served = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text
        assert served == engine.generate([prompt], {"max_tokens": 12, "temperature": 0, "ignore_eos": True})[0].text
    assert stack.stats("d0")["tensor_parallel_size"] == 2


def test_it_refuses_the_prefill_role(stack):
    """It would ship rank 0's heads only: until KV moves between TP sizes, no prefill role."""
    with pytest.raises(urllib.error.HTTPError) as info:
        stack.worker_json("d0", "/admin/role", "POST", json.dumps({"role": "prefill"}).encode())
    assert info.value.code == 400 and b"tensor-parallel" in info.value.read()
    assert stack.stats("d0")["role"] == "decode"


def test_a_dead_follower_fails_the_whole_worker(stack):
    worker = psutil.Process(stack.procs["d0"].popen.pid)
    followers = [p for p in worker.children(recursive=True)
                 if any("spawn_main" in part for part in p.cmdline())]  # not multiprocessing's resource tracker
    assert followers, "the worker runs its follower rank as a child process"
    followers[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 120
    while stack.procs["d0"].popen.poll() is None:
        assert time.monotonic() < deadline, "the worker did not fail when its follower rank died"
        time.sleep(0.1)
    assert stack.procs["d0"].popen.returncode != 0
