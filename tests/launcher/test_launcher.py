"""``make up`` supervises its stack: a process that dies comes back while the rest keep serving,
and Ctrl-C (SIGINT) stops every process it started."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import openai
import psutil
import pytest

from common.cluster.auth import ClusterAuth, generate_secret
from launcher.local_stack import ROOT, LocalStack, free_port, http_json
from launcher.supervisor import Supervisor
from common.cluster.redis_util import connect
from common.cluster.registry import WorkerRegistry
from tests.support.cluster import delete_keys

WAIT = 240.0  # generous: several processes start on two shared cores


def test_supervisor_backs_off_while_a_process_keeps_exiting(tmp_path):
    """A process that exits right after starting is restarted after 1x, 2x, 4x... the minimum
    backoff, capped; the stack's other processes are not touched."""
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path)
    stack._spawn("flaky", "platform", [], port=0)  # prints the platform and exits at once
    stack._spawn("steady", "http.server", ["--bind", "127.0.0.1", "0"], port=0)
    said: list[str] = []
    supervisor = Supervisor(stack, min_backoff=0.05, max_backoff=0.2, say=lambda msg, **_: said.append(msg))
    try:
        deadline = time.monotonic() + WAIT
        while supervisor.restarts.get("flaky", 0) < 4:
            assert time.monotonic() < deadline, said
            supervisor.poll()
            time.sleep(0.01)
        delays = [msg.split(" in ")[1] for msg in said if msg.startswith("flaky stopped")]
        assert delays[:4] == ["0.05 s", "0.10 s", "0.20 s", "0.20 s"]  # doubling, capped
        assert "steady" not in supervisor.restarts and stack.procs["steady"].alive
        assert "exit status 0" in said[0]
    finally:
        stack.stop()


def test_supervisor_gives_up_a_crash_loop_and_fails_only_without_the_gateway(tmp_path):
    """After ``crash_loop_limit`` short runs in a row a process is not started again: a worker
    given up leaves the stack serving, the gateway given up makes the supervisor fail (run returns)."""
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path)
    stack._spawn("flaky", "platform", [], port=0)
    stack._spawn("steady", "http.server", ["--bind", "127.0.0.1", "0"], port=0)
    said: list[str] = []
    supervisor = Supervisor(stack, min_backoff=0.01, max_backoff=0.02, crash_loop_limit=3,
                            say=lambda msg, **_: said.append(msg))
    try:
        deadline = time.monotonic() + WAIT
        while "flaky" not in supervisor.given_up:
            assert time.monotonic() < deadline, said
            supervisor.poll()
            time.sleep(0.01)
        assert supervisor.restarts["flaky"] == 2  # three runs in all
        assert "crash loop" in said[-1] and not supervisor.failed
        for _ in range(20):  # given up: never started again
            supervisor.poll()
            time.sleep(0.01)
        assert supervisor.restarts["flaky"] == 2 and stack.procs["steady"].alive

        stack._spawn("gateway", "platform", [], port=0)
        supervisor.run(lambda: time.monotonic() > deadline, interval=0.01)  # returns once the gateway is given up
        assert supervisor.failed and "gateway" in supervisor.given_up and "cannot serve" in said[-1]
        assert stack.procs["steady"].alive
    finally:
        stack.stop()


def find_child(launcher: psutil.Process, worker_id: str) -> psutil.Process | None:
    for child in launcher.children():
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--worker-id" in cmdline and cmdline[cmdline.index("--worker-id") + 1] == worker_id:
            return child
    return None


def registered_since(redis_url: str, key_prefix: str, secret: str, model: str, worker_id: str, after: float) -> bool:
    async def check():
        client = connect(redis_url)
        try:
            info = await WorkerRegistry(client, key_prefix=key_prefix, auth=ClusterAuth(secret)).get(model, worker_id)
        finally:
            await client.aclose()
        return info is not None and info.started_at > after and info.state == "active"

    return asyncio.run(check())


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.mark.slow(seconds=22)
def test_make_up_restarts_a_killed_worker_and_sigint_stops_everything(served_checkpoint, redis_url, tmp_path):
    port = free_port()
    key_prefix = f"pdtest-{uuid.uuid4().hex[:12]}"
    secret, api_key = generate_secret(), generate_secret()  # (an API key: the stack starts with one too)
    env = dict(os.environ, REDIS_URL=redis_url, PDSERVE_KEY_PREFIX=key_prefix, PDSERVE_HEARTBEAT_TTL="2",
               PDSERVE_BLOCK_SIZE="4", PDSERVE_CLUSTER_SECRET=secret, PDSERVE_API_KEY=api_key, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop("PDSERVE_CLUSTER_SECRET_FILE", None)
    log_path = tmp_path / "launcher.log"
    with log_path.open("w") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "launcher", "--model", str(served_checkpoint), "--port", str(port),
             "--prefill", "1", "--decode", "2", "--num-blocks", "256", "--kv-transport", "tcp",
             "--key-prefix", key_prefix, "--restart-backoff", "0.5"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    launcher = psutil.Process(popen.pid)
    gateway = f"http://127.0.0.1:{port}"
    model = served_checkpoint.name
    children: list[psutil.Process] = []
    try:
        def serving():
            assert popen.poll() is None, log_path.read_text()
            if "A process that stops is restarted" not in log_path.read_text():
                return False  # still starting: a process lost now stops the launcher, by design
            try:
                return http_json(f"{gateway}/health", timeout=2)["workers"] == {"prefill": 1, "decode": 2, "both": 0}
            except OSError:
                return False

        wait_for(serving, "the stack to serve")
        # Its curl example, run as printed (a shell that has the key), is answered.
        printed = log_path.read_text()
        example = printed[printed.index("  curl "):printed.index("A process that stops")].replace("\\\n", " ")
        assert '-H "Authorization: Bearer $PDSERVE_API_KEY"' in example
        answered = subprocess.run(["bash", "-c", example.replace("curl ", "curl -sS -w '\\n%{http_code}' ", 1)],
                                  env=env, capture_output=True, text=True, timeout=120)
        assert answered.stdout.rstrip().endswith("200"), (example, answered.stdout, answered.stderr)
        children = launcher.children()
        gateway_pid = next(c.pid for c in children if "gateway" in c.cmdline())
        killed_at = time.time()
        find_child(launcher, "d0").kill()

        # Requests keep succeeding (the gateway retries on the other decode worker) while the
        # launcher brings d0 back and it registers again.
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0)
        served = 0
        while True:
            response = client.completions.create(model=model, prompt=f"Request {served} after the crash",
                                                 max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
            assert response.choices[0].finish_reason == "length"
            served += 1
            if registered_since(redis_url, key_prefix, secret, model, "d0", killed_at):
                break
            assert time.time() - killed_at < WAIT, f"d0 did not come back:\n{log_path.read_text()}"
        assert served >= 1
        wait_for(serving, "the restarted worker to serve")
        assert "d0 stopped (killed by SIGKILL)" in log_path.read_text()
        children = launcher.children()
        # The gateway was never restarted: the same process served throughout.
        assert gateway_pid in [c.pid for c in children if "gateway" in c.cmdline()]
        assert "gateway stopped" not in log_path.read_text()

        popen.send_signal(signal.SIGINT)
        assert popen.wait(WAIT) == 0, log_path.read_text()
        gone, alive = psutil.wait_procs(children, timeout=WAIT)
        assert not alive, f"still running after the launcher stopped: {alive}"
    finally:
        for proc in [launcher, *children]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        delete_keys(redis_url, key_prefix)


@pytest.mark.parametrize("env, header", [
    ({"PDSERVE_API_KEY": "k" * 40}, ' -H "Authorization: Bearer $PDSERVE_API_KEY"'),
    ({"PDSERVE_API_KEYS_FILE": "/run/keys"}, " -H 'Authorization: Bearer <a key from your PDSERVE_API_KEYS_FILE>'"),
    ({"PDSERVE_API_KEYS_FILE": ""}, ""), ({}, "")])
def test_the_curl_example_sends_a_key_where_the_gateway_wants_one_and_never_shows_it(env, header):
    from launcher.run import curl_key_header
    assert curl_key_header(env) == header
