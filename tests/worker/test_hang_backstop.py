"""An engine step that hangs in native code holding the GIL stops every Python thread of the
process -- the watchdog's, the event loop's, any timer's.  The hang backstop (faulthandler's C
timer, armed around the engine thread's work) still ends the process: tracebacks on stderr, exit
status 1, so the supervisor restarts it.  Before it, such a worker hung for good.

A real process (the test's own would be frozen too), with a real engine and engine thread; the
step holds the GIL through ``PDSERVE_TEST_HANG_STEPS`` + ``PDSERVE_TEST_HANG_HOLDS_GIL``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import tiny_llama_config, write_checkpoint

pytestmark = pytest.mark.slow(seconds=17)  # a long file: scheduled by its length (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
WAIT = 300.0  # turns a hang into a failure; far beyond what the backstop takes (a few seconds)

SCRIPT = """
import asyncio, sys
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from worker.engine_thread import EngineThread
from worker.fault_injection import fault_injector_from_env

async def main(checkpoint):
    engine = Engine(EngineConfig(model=checkpoint, block_size=4, num_blocks=32, compile=False), load_tokenizer=False)
    thread = EngineThread(engine, asyncio.get_running_loop(), watchdog_s=0.5, hang_backstop=True)
    engine.fault_injector = fault_injector_from_env()
    thread.start()
    stream = thread.open_stream("a")
    print("adding", flush=True)  # the step may take the GIL before the call returns here
    await thread.call(lambda e: e.add_request([5, 6, 7], {"max_tokens": 2}, "a"))
    print("answered:", await stream.get(), flush=True)  # the step holds the GIL: never

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tiny_llama_config(max_position_embeddings=128), tmp_path_factory.mktemp("llama"))


def test_a_step_that_hangs_holding_the_gil_still_ends_the_process(checkpoint):
    env = dict(os.environ, PDSERVE_TEST_HANG_STEPS="1", PDSERVE_TEST_HANG_HOLDS_GIL="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(checkpoint)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process never ended:\n{out}\n{err[-3000:]}")
    assert "adding" in out and "answered" not in out, out
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    # faulthandler's dump: the timeout, then the engine thread's stack in the hung step.
    assert "Timeout (" in err and "fault_injection.py" in err, err[-3000:]
