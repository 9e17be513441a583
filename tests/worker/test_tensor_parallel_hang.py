"""A tensor-parallel worker whose follower rank hangs (SIGSTOP) fails as a whole: rank 0's next
collective waits, the engine watchdog gives up on the step, and the worker leaves the pool and
exits non-zero; the client gets an error, not a hang."""
from __future__ import annotations

import signal
import time

import openai
import psutil
import pytest

from tests.support.cluster import running_cluster

pytestmark = pytest.mark.slow(seconds=23)  # a long file: scheduled by its length (tests/conftest.py)

WATCHDOG_S = 5  # a step of this tiny model takes milliseconds; the first of each kind gets 4x


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("tp-hang-logs"), redis_url, prefill=0, decode=1,
                         worker_args=["--num-blocks", "128", "--block-size", "4", "--tensor-parallel-size", "2",
                                      "--no-compile", "--engine-watchdog", str(WATCHDOG_S)]) as c:
        assert c.wait_for_workers(prefill=0, decode=1, timeout=180)
        yield c


def test_a_hung_follower_fails_the_whole_worker(stack):
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=120)
    # Steps of both kinds have run: the watchdog's bound is the plain one from here on.
    client.completions.create(model=stack.model_name, prompt="warm up " * 20, max_tokens=4, temperature=0)
    worker = psutil.Process(stack.procs["d0"].popen.pid)
    follower = next(p for p in worker.children(recursive=True) if any("spawn_main" in a for a in p.cmdline()))
    follower.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(openai.APIError):
            client.completions.create(model=stack.model_name, prompt="never answered", max_tokens=8, temperature=0)
        deadline = time.monotonic() + 120
        while stack.procs["d0"].popen.poll() is None:
            assert time.monotonic() < deadline, "the worker did not fail when its follower rank hung"
            time.sleep(0.1)
        assert stack.procs["d0"].popen.returncode != 0
    finally:
        if follower.is_running():
            follower.send_signal(signal.SIGCONT)
