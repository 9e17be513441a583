"""Who needs the cluster secret, and where it comes from: workers and the gateway refuse to start
with a listener off loopback and no secret, or with a weak one; the local stack always has one."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launcher import local_stack as launcher
from common.cluster.auth import SECRET_ENV, AuthError, ClusterAuth, generate_secret, read_secret
from launcher.local_stack import ROOT, LocalStack, local_secret
from worker.config import build_parser, config_from_args
from gateway.config import GatewayConfig

GOOD = generate_secret()


def worker_config(monkeypatch, *flags: str, secret: str | None = None):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    if secret is not None:
        monkeypatch.setenv(SECRET_ENV, secret)
    return config_from_args(build_parser("decode", "test").parse_args(list(flags)))


def test_worker_on_loopback_runs_without_a_secret(monkeypatch):
    config = worker_config(monkeypatch)
    assert not config.auth().enabled


@pytest.mark.parametrize("flags", [["--host", "0.0.0.0"], ["--kv-host", "10.1.2.3"], ["--host", "worker-3"]])
def test_worker_with_an_exposed_listener_needs_a_secret(monkeypatch, flags):
    with pytest.raises(ValueError, match=f"no cluster secret is set: set {SECRET_ENV}"):
        worker_config(monkeypatch, *flags)
    assert worker_config(monkeypatch, *flags, secret=GOOD).auth().enabled


@pytest.mark.parametrize("weak, why", [("change-me-to-something-long", "placeholder"), ("short", "shorter than")])
def test_weak_secrets_are_refused_even_on_loopback(monkeypatch, weak, why):
    with pytest.raises(ValueError, match=why):
        worker_config(monkeypatch, secret=weak)
    with pytest.raises(ValueError, match=why):
        GatewayConfig(cluster_secret=weak)


def test_secret_file_takes_precedence_and_is_never_printed(monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_text(GOOD + "\n")
    config = worker_config(monkeypatch, "--host", "0.0.0.0", "--cluster-secret-file", str(path),
                           secret="other-secret-from-the-environment")
    assert config.cluster_secret == GOOD
    assert GOOD not in repr(config) and GOOD not in repr(GatewayConfig(cluster_secret=GOOD))
    with pytest.raises(AuthError, match="cannot read the cluster secret file"):
        read_secret(str(tmp_path / "missing"))
    assert read_secret(None, {SECRET_ENV: ""}) is None  # an empty variable means unset


def test_gateway_with_an_exposed_listener_needs_a_secret():
    GatewayConfig(host="127.0.0.1")
    with pytest.raises(ValueError, match=SECRET_ENV):
        GatewayConfig(host="0.0.0.0")
    assert GatewayConfig(host="0.0.0.0", cluster_secret=GOOD, allow_no_api_key=True).auth().enabled


@pytest.mark.parametrize("module, flags", [("decode_svc", ["--host", "0.0.0.0"]),
                                           ("prefill_svc", ["--kv-host", "0.0.0.0"]),
                                           ("gateway", ["--host", "0.0.0.0"])])
def test_services_refuse_to_start_with_a_clear_message(module, flags):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    assert result.returncode != 0
    assert SECRET_ENV in result.stderr and "other machines can reach" in result.stderr


def test_local_stack_gives_every_process_the_secret_and_the_admin_token_to_the_gateway_only(monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "admin-token-from-make-up")
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN_FILE", "/run/secrets/admin")
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET_FILE", "/nonexistent")  # must not override the stack's secret
    stack = LocalStack("ckpt", "redis://127.0.0.1:1", cluster_secret=GOOD)
    gateway, worker = stack.process_env(gateway=True), stack.process_env()
    assert gateway[SECRET_ENV] == worker[SECRET_ENV] == GOOD
    assert gateway["PDSERVE_ADMIN_TOKEN"] == "admin-token-from-make-up"
    assert "PDSERVE_ADMIN_TOKEN" not in worker and "PDSERVE_ADMIN_TOKEN_FILE" not in worker  # signed calls only
    assert "PDSERVE_CLUSTER_SECRET_FILE" not in gateway and "PDSERVE_CLUSTER_SECRET_FILE" not in worker
    # A stack built without one still gets a fresh, strong secret.
    assert ClusterAuth(LocalStack("ckpt", "redis://127.0.0.1:1").process_env()[SECRET_ENV]).enabled


def test_make_up_uses_the_environment_secret_or_generates_one():
    assert local_secret({SECRET_ENV: GOOD}) == GOOD
    first, second = local_secret({}), local_secret({SECRET_ENV: ""})
    assert first != second and len(first) >= 32
    with pytest.raises(SystemExit, match="placeholder"):
        local_secret({SECRET_ENV: "change-me"})


def test_local_stack_passes_the_redis_url_in_the_environment_never_on_a_command_line(monkeypatch):
    """A REDIS_URL may hold a password: ``ps`` shows every user the command lines, not environments."""
    started = []
    monkeypatch.setattr(launcher, "worker_drain_timeout", lambda args, env: 1.0)
    url = "redis://:hunter2-redis-password@10.0.0.5:6379"
    stack = LocalStack("ckpt", url, cluster_secret=GOOD,
                       spawner=lambda command, **kwargs: started.append((command, kwargs["env"])))
    stack.start_worker("d0", "decode")
    stack.start_gateway()
    assert len(started) == 2
    for command, env in started:
        assert not any("hunter2" in arg for arg in command), command
        assert env["REDIS_URL"] == env["PDSERVE_REDIS_URL"] == url
