"""pdctl's deployment commands: gen-secrets, the compose backend's exact commands, and rollout,
drain-aware scale and the metrics proxy against one real local stack (launcher processes, real
Redis, the gateway's admin API)."""
from __future__ import annotations

import asyncio
import json
import stat
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

from common.cluster.auth import secret_problem
from pdctl import cli as pdctl
from pdctl.deploy.backends import ComposeBackend, LocalBackend, Replica
from pdctl.deploy.cli import cmd_scale
from pdctl.deploy.env_file import SHARED_SECRETS, read_env_file
from pdctl.deploy.rollout import OperationError, Operator
from tests.support.cluster import ADMIN_TOKEN, running_cluster

pytestmark = pytest.mark.slow(seconds=30)  # a long file: scheduled by its length (tests/conftest.py)
STEP_DELAY_S = 0.02  # added to every engine step of the shared stack's workers

# ---- gen-secrets ---------------------------------------------------------------------------------


def test_gen_secrets_writes_a_private_env_file_with_strong_secrets(tmp_path, capsys):
    from pdctl.deploy.env_file import HOST_SECRETS

    path = tmp_path / "compose" / ".env"
    assert pdctl.main(["gen-secrets", "--env-file", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = read_env_file(path)
    assert values["COMPOSE_PROJECT_NAME"] == "pdserve" and values["PDSERVE_STACK"] == "gpu"
    for key in SHARED_SECRETS + HOST_SECRETS:
        assert secret_problem(values[key]) is None, key
    assert len({values[k] for k in SHARED_SECRETS + HOST_SECRETS}) == len(SHARED_SECRETS + HOST_SECRETS)  # all different
    assert "--env-file" in capsys.readouterr().out
    # Never over secrets in use, unless asked.
    assert pdctl.main(["gen-secrets", "--env-file", str(path)]) == 1
    assert read_env_file(path) == values
    # Another host's file: the same secrets, its own project and settings.
    workers = tmp_path / "workers.env"
    assert pdctl.main(["gen-secrets", "--stack", "workers", "--from", str(path), "--env-file", str(workers),
                       "--set", "HOST_ADDR=10.0.0.12", "--set", "REDIS_HOST=10.0.0.11"]) == 0
    other = read_env_file(workers)
    assert other["COMPOSE_PROJECT_NAME"] == "pdserve-workers" and other["HOST_ADDR"] == "10.0.0.12"
    assert all(other[k] == values[k] for k in SHARED_SECRETS)
    assert all(other[k] != values[k] and secret_problem(other[k]) is None for k in HOST_SECRETS)  # its own
    assert stat.S_IMODE(workers.stat().st_mode) == 0o600


def test_gen_secrets_refuses_weak_sources_and_bad_settings(tmp_path):
    weak = tmp_path / "weak.env"
    weak.write_text("PDSERVE_CLUSTER_SECRET=change-me\n")
    assert pdctl.main(["gen-secrets", "--from", str(weak), "--env-file", str(tmp_path / "x.env")]) == 2
    assert pdctl.main(["gen-secrets", "--set", "nonsense", "--env-file", str(tmp_path / "y.env")]) == 2
    assert not (tmp_path / "x.env").exists() and not (tmp_path / "y.env").exists()


# ---- the compose backend: the exact commands ------------------------------------------------------


class Recorder:
    """Answers docker commands from a table and records every command run."""

    def __init__(self, answers: dict[tuple[str, ...], str]):
        self.answers, self.commands = answers, []

    def __call__(self, cmd: list[str]) -> str:
        self.commands.append(cmd)
        for prefix, answer in self.answers.items():
            if tuple(cmd[:len(prefix)]) == prefix:
                return answer
        return ""


def test_compose_backend_commands():
    ps = ["docker", "ps", "-a", "--no-trunc", "--filter", "label=com.docker.compose.project=pdserve-workers",
          "--filter", "label=com.docker.compose.service=decode", "--format", "{{.ID}} {{.Names}} {{.State}}"]
    run = Recorder({tuple(ps): "c1 pdserve-workers-decode-1 running\nc2 pdserve-workers-decode-2 exited\n",
                    ("docker", "exec", "c1"): json.dumps({"worker_id": "h1-gpu3"}),
                    ("docker", "inspect"): "healthy\n"})
    backend = ComposeBackend("pdserve-workers", ["compose/docker-compose.workers.yml"], "compose/workers.env",
                             "docker-compose", runner=run)
    replicas = backend.replicas("decode")
    assert replicas == [Replica("c1", "decode", "pdserve-workers-decode-1", "h1-gpu3", True),
                        Replica("c2", "decode", "pdserve-workers-decode-2", None, False)]
    assert run.commands == [ps, ["docker", "exec", "c1", "python", "/opt/pdserve/compose/entrypoint.py", "--whoami"]]
    run.commands.clear()
    backend.remove(replicas[0], 150)
    backend.ensure("decode", 6)
    assert backend.healthy(replicas[0])
    assert run.commands == [
        ["docker", "stop", "--time", "150", "c1"],
        ["docker", "rm", "c1"],
        ["docker-compose", "-p", "pdserve-workers", "--env-file", "compose/workers.env",
         "-f", "compose/docker-compose.workers.yml", "up", "-d", "--no-deps", "--no-recreate", "--scale", "decode=6",
         "decode"],
        ["docker", "inspect", "--format", "{{.State.Health.Status}}", "c1"],
    ]


def test_scale_down_picks_exited_then_idle_replicas():
    replicas = [Replica("a", "decode", "d-1", "w1"), Replica("b", "decode", "d-2", "w2"),
                Replica("c", "decode", "d-3", None, running=False), Replica("d", "decode", "d-4", "w4")]
    entries = {"w1": {"load": {"num_running": 5}}, "w2": {"load": {"num_running": 0, "num_waiting": 1}},
               "w4": {"load": {"num_running": 0}}}
    assert [r.name for r in Operator.victims(replicas, 1, entries)] == ["d-3"]
    assert [r.name for r in Operator.victims(replicas, 3, entries)] == ["d-3", "d-4", "d-2"]


class Refusing:
    """An admin API whose drain of ``refused`` fails; it records drains and role changes."""

    def __init__(self, refused: str):
        self.refused, self.calls = refused, []
        self.roles = {"w1": "decode", "w2": "decode", "w3": "decode"}

    def workers(self):
        return [{"worker_id": w, "role": role, "state": "active", "heartbeat_at": 1.0} for w, role in self.roles.items()]

    def drain(self, worker_id):
        if worker_id == self.refused:
            raise pdctl.AdminError(f"{worker_id}: connection refused")
        self.calls.append(("drain", worker_id))

    def set_role(self, worker_id, role):
        self.calls.append(("role", worker_id, role))

    def wait_for(self, *args):
        raise AssertionError("no wait: a drain failed first")


def test_a_scale_down_that_cannot_drain_a_victim_puts_the_drained_ones_back():
    """The second victim's drain failed: the first stayed draining -- out of the pools, never removed."""
    client = Refusing("w2")
    op = Operator(client, None, say=lambda _line: None)
    victims = [Replica("a", "decode", "d-1", "w1"), Replica("b", "decode", "d-2", "w2")]
    with pytest.raises(OperationError, match=r"w2: connection refused \(back in service: d-1\)"):
        op.drain(victims)
    assert client.calls == [("drain", "w1"), ("role", "w1", "decode")]


def test_scale_refuses_an_empty_decode_pool_without_allow_outage():
    args = SimpleNamespace(gpus=None, prefill=2, decode=0, allow_outage=False)
    with pytest.raises(ValueError, match="--decode 0 leaves no worker to generate"):
        cmd_scale(None, args)


# ---- against a local stack (one per module: starting workers is the slow part) ----------------------


class Admin:
    """The slice of pdctl's AdminClient the operator uses, over the real admin API."""

    def __init__(self, url: str):
        self.client = pdctl.AdminClient(url, ADMIN_TOKEN)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture(scope="module")
def stack(served_checkpoint, tmp_path_factory, redis_url):
    # Steps slowed down: a 200-token stream stays in flight for seconds, long enough for the
    # heartbeats to show it and for a drain to find it (the tiny model alone ends it in a blink).
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("deploy"), redis_url, prefill=1, decode=2,
                         worker_args=["--num-blocks", "256", "--drain-timeout", "60"],
                         extra_env={"PDSERVE_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}) as cluster:
        yield cluster


def operator(stack, **kw) -> Operator:
    return Operator(Admin(stack.gateway_url), LocalBackend(stack), drain_timeout=60, ready_timeout=120,
                    stop_grace_s=30, say=lambda _line: None, poll_s=0.2, **kw)


def completion(stack, max_tokens: int, timeout: float = 120) -> dict:
    body = json.dumps({"model": stack.model_name, "prompt": "Deployments should never drop a stream",
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{stack.gateway_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def pids(stack) -> dict[str, int]:
    return {name: proc.popen.pid for name, proc in stack.procs.items() if name != "gateway"}


def test_rollout_replaces_decode_workers_one_at_a_time_without_failing_a_request(stack):
    before = pids(stack)
    stop = threading.Event()
    results = {"ok": 0, "failed": []}

    def load():
        while not stop.is_set():
            try:
                answer = completion(stack, 8)
                assert answer["usage"]["completion_tokens"] == 8
                results["ok"] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                body = exc.read().decode(errors="replace")[:300] if hasattr(exc, "read") else ""
                results["failed"].append(f"{exc!r} {body}")

    clients = [threading.Thread(target=load)]  # back-to-back requests: traffic never pauses
    for c in clients:
        c.start()
    try:
        op = operator(stack)
        replaced = op.rollout(["decode"])
    finally:
        stop.set()
        for c in clients:
            c.join(60)
    assert results["failed"] == [] and results["ok"] > 0, results
    assert sorted(old.name for old, _new in replaced) == ["d0", "d1"]
    # One at a time: each replacement was ready before the next worker began to drain.
    steps = [what for what, _name in op.events]
    assert steps == ["drain", "idle", "removed", "ready"] * 2, op.events
    after = pids(stack)
    assert "d0" not in after and "d1" not in after and after["p0"] == before["p0"]
    stack.wait_for_workers(1, 2, timeout=60)


def test_rollout_refuses_to_take_down_a_pools_only_worker(stack):
    before = pids(stack)
    with pytest.raises(OperationError, match="only active worker of the prefill pool"):
        operator(stack).rollout(["prefill"])
    assert pids(stack) == before


def test_scale_down_drains_exactly_the_workers_it_removes(stack):
    op = operator(stack)
    decoders = [r for r in LocalBackend(stack).replicas("decode")]
    assert len(decoders) == 2
    # A long stream on every decode worker, so whichever is removed has one in flight.
    streams, threads, errors = [], [], []

    def stream():
        try:
            streams.append(completion(stack, 200))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    admin = Admin(stack.gateway_url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loads = {w["worker_id"]: w["load"] for w in admin.workers() if w["role"] == "decode"}
        busy = {worker_id for worker_id, load in loads.items() if load["num_running"] > 0}
        if busy >= {r.worker_id for r in decoders}:
            break
        if sum(t.is_alive() for t in threads) < 8:  # streams end; keep eight going until both are seen busy
            threads.append(threading.Thread(target=stream))
            threads[-1].start()
        time.sleep(0.3)
    assert busy >= {r.worker_id for r in decoders}, f"only {busy} seen with a stream in flight: {loads} {errors[:3]}"
    plan = op.plan_scale({"prefill": 1, "decode": 1})
    victim = plan.remove["decode"][0]
    assert plan.remove == {"decode": [victim]} and victim.handle in {r.handle for r in decoders}
    keeper = next(r for r in decoders if r.handle != victim.handle)
    keeper_pid = stack.procs[keeper.handle].popen.pid
    op.scale(plan)
    for t in threads:
        t.join(120)
    assert errors == [] and len(streams) == len(threads)
    assert all(s["usage"]["completion_tokens"] == 200 for s in streams)
    assert [what for what, name in op.events if name == victim.name] == ["drain", "idle", "removed"]
    assert victim.handle not in stack.procs and stack.procs[keeper.handle].popen.pid == keeper_pid
    stack.wait_for_workers(1, 1, timeout=60)
    # And back up: a new worker that serves.
    op.scale(op.plan_scale({"prefill": 1, "decode": 2}))
    assert op.events[-1][0] == "ready"
    stack.wait_for_workers(1, 2, timeout=60)
    assert completion(stack, 4)["usage"]["completion_tokens"] == 4


def test_metrics_proxy_lists_workers_and_relays_their_metrics(stack):
    from aiohttp.test_utils import TestClient, TestServer

    from common.cluster.auth import ClusterAuth
    from pdctl.deploy.metrics_proxy import MetricsProxy

    async def check():
        proxy = MetricsProxy(stack.gateway_url, ADMIN_TOKEN, ClusterAuth(stack.cluster_secret), "proxy:9401",
                             dcgm_targets="workers:9400", scrape_token=None)  # scrapers' auth: tested below
        async with TestClient(TestServer(proxy.app())) as client:
            targets = await (await client.get("/targets/workers")).json()
            ids = {t["labels"]["worker_id"] for t in targets}
            assert len(ids) == 3 and all(t["targets"] == ["proxy:9401"] for t in targets)
            decode = next(t for t in targets if t["labels"]["role"] == "decode")
            resp = await client.get(decode["labels"]["__metrics_path__"])
            assert resp.status == 200 and "pdserve_worker_kv_usage" in await resp.text()
            assert (await client.get("/workers/nobody/metrics")).status == 404
            dcgm = await (await client.get("/targets/dcgm")).json()
            assert dcgm == [{"targets": ["127.0.0.1:9400"], "labels": {"job": "dcgm"}}]
        wrong = MetricsProxy(stack.gateway_url, "wrong-token", ClusterAuth.disabled(), "proxy:9401", scrape_token=None)
        async with TestClient(TestServer(wrong.app())) as client:
            assert (await client.get("/targets/workers")).status == 502
        # Workers answer only signed scrapes: without the cluster secret the relay gets nothing.
        unsigned = MetricsProxy(stack.gateway_url, ADMIN_TOKEN, ClusterAuth("not-the-cluster-secret"), "proxy:9401",
                                scrape_token=None)
        async with TestClient(TestServer(unsigned.app())) as client:
            assert (await client.get(decode["labels"]["__metrics_path__"])).status == 502

    asyncio.run(check())


def test_metrics_proxy_relays_only_to_scrapers_with_its_token():
    """Anyone on the compose network reaches the proxy; only Prometheus holds its token.  A refused
    scrape costs nothing: no call to the gateway or a worker (the gateway URL here answers nothing)."""
    from aiohttp.test_utils import TestClient, TestServer

    from common.cluster.auth import ClusterAuth
    from pdctl.deploy.metrics_proxy import MetricsProxy

    token = "scrape-" + "x" * 32

    async def check():
        proxy = MetricsProxy("http://127.0.0.1:9", None, ClusterAuth.disabled(), "proxy:9401",
                             dcgm_targets="dcgm:9400", scrape_token=token)
        async with TestClient(TestServer(proxy.app())) as client:
            assert (await client.get("/health")).status == 200  # the container's health check carries no token
            for path in ("/targets/dcgm", "/targets/workers", "/workers/w1/metrics"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token},
                                {"Authorization": f"Bearer {token}x"}, {"Authorization": "Bearer \u00e9t\u00e9"}):
                    resp = await client.get(path, headers=headers)
                    assert resp.status == 401, (path, headers, resp.status)
                    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            resp = await client.get("/targets/dcgm", headers={"Authorization": f"Bearer {token}"})
            assert resp.status == 200 and await resp.json() == [{"targets": ["dcgm:9400"], "labels": {"job": "dcgm"}}]

    asyncio.run(check())


def test_metrics_proxy_refuses_to_listen_openly_without_a_strong_distinct_token(monkeypatch, capsys):
    for name in ("PDSERVE_METRICS_TOKEN", "PDSERVE_METRICS_TOKEN_FILE", "PDSERVE_ADMIN_TOKEN", "PDSERVE_ADMIN_TOKEN_FILE",
                 "PDSERVE_CLUSTER_SECRET", "PDSERVE_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    served = []
    monkeypatch.setattr("pdctl.deploy.metrics_proxy.serve", lambda proxy, host, port: served.append((proxy, host, port)))
    assert pdctl.main(["metrics-proxy", "--listen", "0.0.0.0:9401"]) == 2
    assert "has no scrape token: set PDSERVE_METRICS_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_METRICS_TOKEN", "short")
    assert pdctl.main(["metrics-proxy", "--listen", "0.0.0.0:9401"]) == 2
    assert "metrics token (PDSERVE_METRICS_TOKEN) is not acceptable" in capsys.readouterr().err
    strong = "m" * 32
    monkeypatch.setenv("PDSERVE_METRICS_TOKEN", strong)
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", strong)
    assert pdctl.main(["metrics-proxy", "--listen", "0.0.0.0:9401"]) == 2
    err = capsys.readouterr().err
    assert "the admin token and the metrics token are the same value" in err and strong not in err
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "a" * 32)
    assert pdctl.main(["metrics-proxy", "--listen", "0.0.0.0:9401"]) == 0
    assert served[-1][1:] == ("0.0.0.0", 9401) and served[-1][0]._token_digest is not None
    monkeypatch.delenv("PDSERVE_METRICS_TOKEN")
    assert pdctl.main(["metrics-proxy", "--listen", "127.0.0.1:9401"]) == 0  # only this machine reaches it
    assert served[-1][0]._token_digest is None


def test_pdctl_reads_the_admin_token_from_a_file_and_never_shows_it(tmp_path, monkeypatch, capsys):
    token = "admin-" + "t" * 32
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", token)
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit):
        pdctl.main(["--help"])
    out = capsys.readouterr().out
    assert token not in out and "PDSERVE_ADMIN_TOKEN or the file --admin-token-file; never shown" in out
    path = tmp_path / "admin-token"
    path.write_text(token + "\n")
    monkeypatch.delenv("PDSERVE_ADMIN_TOKEN")
    seen = []
    monkeypatch.setattr(pdctl, "cmd_status", lambda client, args: seen.append(client.token) or 0)
    assert pdctl.main(["--admin-token-file", str(path), "status"]) == 0 and seen == [token]


def test_scale_plan_names_the_containers_it_removes():
    ps = ["docker", "ps", "-a", "--no-trunc", "--filter", "label=com.docker.compose.project=pdserve",
          "--filter", "label=com.docker.compose.service=decode", "--format", "{{.ID}} {{.Names}} {{.State}}"]
    run = Recorder({tuple(ps): "c1 pdserve-decode-1 running\nc2 pdserve-decode-2 running\nc3 pdserve-decode-3 exited\n",
                    ("docker", "exec", "c1"): json.dumps({"worker_id": "h-gpu0"}),
                    ("docker", "exec", "c2"): json.dumps({"worker_id": "h-gpu1"})})

    class Registry:  # the admin API's answer, as a fixed reading
        def workers(self):
            return [{"worker_id": "h-gpu0", "role": "decode", "state": "active", "load": {"num_running": 3}},
                    {"worker_id": "h-gpu1", "role": "decode", "state": "active", "load": {"num_running": 0}}]

    backend = ComposeBackend("pdserve", ["compose/docker-compose.yml"], "compose/.env", runner=run)
    op = Operator(Registry(), backend, say=lambda _line: None)
    plan = op.plan_scale({"decode": 1})
    assert [r.name for r in plan.remove["decode"]] == ["pdserve-decode-3", "pdserve-decode-2"]
    assert plan.describe({w["worker_id"]: w for w in Registry().workers()}) == [
        "decode: 3 -> 1 replica(s)",
        "  remove pdserve-decode-3 (not running)",
        "  remove pdserve-decode-2 (worker h-gpu1, active, 0 running, 0 waiting)",
    ]


def test_the_metrics_proxy_closes_a_connection_that_sends_no_request(tmp_path):
    """The proxy's port has the limits of every HTTP port (``GuardedSite``): a silent socket is closed at
    the header deadline (10 s) instead of being held until aiohttp's keep-alive (75 s under ``run_app``)."""
    import os
    import socket
    import subprocess
    import sys

    from launcher.local_stack import ROOT, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    proc = subprocess.Popen([sys.executable, "-m", "pdctl", "--url", "http://127.0.0.1:9", "metrics-proxy",
                             "--listen", f"127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "metrics-proxy on" in proc.stdout.readline()
        deadline = time.monotonic() + 120
        while True:  # listening shortly after the line above
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the proxy never listened"
                time.sleep(0.1)
        with sock:
            sock.settimeout(60)  # far beyond the 10 s deadline, short of aiohttp's own 75 s
            received = b""
            while chunk := sock.recv(4096):  # socket.timeout: the proxy held the silent socket
                received += chunk
            assert received == b"" or received.startswith(b"HTTP/1.1 408"), received
    finally:
        proc.terminate()
        proc.wait(timeout=60)
