"""``pdctl rollout`` / ``pdctl scale`` when a backend command fails (exits non-zero, times out, is not
installed): the operation stops with an OperationError naming the command -- no traceback -- and
nothing this call drained is left parked out of the pools; the compose tool is checked before
anything drains.  The admin API and the backend are stubs here (unit tests of the Operator); the
compose backend is the real one over a stub runner."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from pdctl.deploy import cli as deploy_cli
from pdctl.deploy.backends import ComposeBackend, Replica
from pdctl.deploy.rollout import OperationError, Operator


class Admin:
    """The admin API: workers w1..wN of one role, all active; it records drains and role changes."""

    def __init__(self, workers: dict[str, str]):
        self.roles, self.calls = dict(workers), []
        self.states = {w: "active" for w in workers}

    def workers(self):
        return [{"worker_id": w, "role": r, "state": self.states[w], "heartbeat_at": 1.0, "started_at": 1.0,
                 "load": {"num_running": 0, "num_waiting": 0}} for w, r in self.roles.items()]

    def drain(self, worker_id):
        self.calls.append(("drain", worker_id))
        self.states[worker_id] = "idle"

    def wait_for(self, worker_id, predicate, what, timeout, before):
        entry = next(w for w in self.workers() if w["worker_id"] == worker_id)
        assert predicate(entry)
        return entry

    def set_role(self, worker_id, role):
        self.calls.append(("role", worker_id, role))
        self.states[worker_id] = "active"


class Backend:
    """Replicas d-1..d-N (worker ids w1..wN); ``fail`` maps a call ("remove:d-2", "ensure", ...) to
    the exception that call raises."""

    def __init__(self, n: int, fail: dict[str, BaseException] | None = None, service: str = "decode"):
        self.live = {f"d-{i}": f"w{i}" for i in range(1, n + 1)}
        self.service, self.fail, self.calls = service, fail or {}, []

    def _maybe_fail(self, what: str) -> None:
        self.calls.append(what)
        if what in self.fail:
            raise self.fail[what]

    def check(self, services):
        self._maybe_fail("check")

    def replicas(self, service):
        self._maybe_fail("replicas")
        return [Replica(h, service, h, w) for h, w in self.live.items()] if service == self.service else []

    def remove(self, replica, grace_s):
        self._maybe_fail(f"remove:{replica.name}")
        del self.live[replica.handle]

    def ensure(self, service, count):
        self._maybe_fail("ensure")

    def healthy(self, replica):
        return True


def operator(admin, backend) -> Operator:
    return Operator(admin, backend, say=lambda _line: None, poll_s=0.0, ready_timeout=0.0)


def failed(cmd: list[str], stderr: str = "") -> subprocess.CalledProcessError:
    return subprocess.CalledProcessError(1, cmd, "", stderr)


def test_a_rollout_whose_removal_fails_puts_the_drained_worker_back():
    admin = Admin({"w1": "decode", "w2": "decode"})
    backend = Backend(2, {"remove:d-1": failed(["docker", "stop", "--time", "150", "d-1"], "permission denied")})
    with pytest.raises(OperationError, match=r"removing d-1: `docker stop --time 150 d-1` exited 1: permission denied"
                                             r" \(back in service: d-1\)"):
        operator(admin, backend).rollout(["decode"])
    assert admin.calls == [("drain", "w1"), ("role", "w1", "decode")]
    assert admin.states == {"w1": "active", "w2": "active"}


def test_a_rollout_that_cannot_recreate_says_what_was_removed():
    admin = Admin({"w1": "decode", "w2": "decode"})
    backend = Backend(2, {"ensure": FileNotFoundError(2, "No such file or directory", "docker")})
    with pytest.raises(OperationError, match=r"recreating decode: docker: command not found; d-1 was removed and not "
                                             r"replaced: decode runs 1 of 2"):
        operator(admin, backend).rollout(["decode"])
    assert backend.calls[-2:] == ["remove:d-1", "ensure"]


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory", "docker"),
                                   failed(["docker", "compose", "version"], "docker: 'compose' is not a docker command.")])
def test_no_compose_tool_is_found_before_anything_drains(error):
    commands = []

    def runner(cmd):
        commands.append(cmd)
        if cmd[:3] == ["docker", "compose", "version"]:
            raise error
        raise AssertionError(f"ran {cmd} after the check failed")

    admin = Admin({"w1": "decode", "w2": "decode"})
    op = operator(admin, ComposeBackend("pdserve", ["compose/docker-compose.yml"], None, runner=runner))
    for run in (lambda: op.rollout(["decode"]), lambda: op.scale(SimpleNamespace(target={"decode": 1}, remove={}))):
        with pytest.raises(OperationError, match=r"the compose tool does not run .*--compose docker-compose"):
            run()
    assert admin.calls == [] and commands == [["docker", "compose", "version"]] * 2


def test_a_scale_down_whose_removal_fails_puts_the_drained_victims_not_removed_back():
    admin = Admin({f"w{i}": "decode" for i in range(1, 5)})
    backend = Backend(4, {"remove:d-3": subprocess.TimeoutExpired(["docker", "stop", "d-3"], 900)})
    op = operator(admin, backend)
    plan = op.plan_scale({"decode": 1})
    assert [r.name for r in plan.remove["decode"]] == ["d-4", "d-3", "d-2"]
    with pytest.raises(OperationError, match=r"removing d-3: `docker stop d-3` ran past 900s "
                                             r"\(back in service: d-3, d-2\)"):
        op.scale(plan)
    assert set(backend.live) == {"d-1", "d-2", "d-3"}  # d-4 went
    assert [c for c in admin.calls if c[0] == "role"] == [("role", "w3", "decode"), ("role", "w2", "decode")]
    assert admin.states == {"w1": "active", "w2": "active", "w3": "active"} | {"w4": "idle"}


def test_pdctl_scale_and_rollout_report_a_backend_failure_without_a_traceback(monkeypatch, capsys):
    admin = Admin({"w1": "decode", "w2": "decode"})
    backend = Backend(2, {"replicas": failed(["docker", "ps"], "Cannot connect to the Docker daemon")})
    monkeypatch.setattr(deploy_cli, "operator", lambda client, args: operator(client, backend))
    args = SimpleNamespace(gpus=None, prefill=0, decode=1, allow_outage=False, run=True, service=None,
                           env_file="/nonexistent.env")
    assert deploy_cli.cmd_scale(admin, args) == 1
    assert deploy_cli.cmd_rollout(admin, args) == 1
    err = capsys.readouterr().err
    assert "pdctl: scale stopped: listing" in err and "Cannot connect to the Docker daemon" in err
    assert "pdctl: rollout stopped:" in err and admin.calls == []


def test_a_missing_deployment_is_found_before_anything_drains():
    from pdctl.deploy.k8s_backend import KubernetesBackend

    def kubectl(cmd):
        assert cmd[:4] == ["kubectl", "get", "deployment", "pdserve-decode"], f"ran {cmd} after the check failed"
        raise failed(cmd, 'Error from server (NotFound): deployments.apps "pdserve-decode" not found')

    admin = Admin({"w1": "decode", "w2": "decode"})
    with pytest.raises(OperationError, match=r"the backend does not answer: .* not found"):
        operator(admin, KubernetesBackend(runner=kubectl)).rollout(["decode"])
    assert admin.calls == []
