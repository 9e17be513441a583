"""compose/: every compose file validates, and what it names exists in the project.

Validation uses the compose CLI when one is installed (``docker compose`` v2, else Debian's
``docker-compose``); the structural checks below run on the YAML itself either way.  No Docker
engine is needed: ``config`` only parses and interpolates.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import yaml

from common.cluster.launcher import ROOT, free_port

COMPOSE = ROOT / "compose"
ENV_EXAMPLE = COMPOSE / ".env.example"
# (files, the services they must define, the extra variables they require)
STACKS = {
    "gpu": (["docker-compose.yml"], {"redis", "gateway", "prefill", "decode"}, {}),
    "cpu": (["docker-compose.cpu.yml"], {"redis", "gateway", "prefill", "decode"}, {}),
    "head": (["docker-compose.yml", "docker-compose.head.yml"], {"redis", "gateway", "prefill", "decode"},
             {"REDIS_BIND_ADDR": "10.0.0.1"}),
    "workers": (["docker-compose.workers.yml"], {"prefill", "decode"},
                {"REDIS_HOST": "10.0.0.1", "HOST_ADDR": "10.0.0.2"}),
}
SECRETS = {"REDIS_PASSWORD": "test-redis-pw", "PDSERVE_ADMIN_TOKEN": "test-admin-token"}
WORKER_SERVICES = ("prefill", "decode")


def compose_cli() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        if subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "REDIS_", "UCX_", "HOST_ADDR"))}
    env.update(extra)
    return env


def render(stack: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    files, _services, _required = STACKS[stack]
    args = [arg for name in files for arg in ("-f", str(COMPOSE / name))]
    return subprocess.run([*compose_cli(), "--project-directory", str(COMPOSE), *args, "config"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} (enough for these files)."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":?" and not value:
            raise KeyError(f"{name}: {arg}")
        if op == ":-" and not value:
            return arg
        return value or ""

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", sub, text)


def load_stack(stack: str, env: dict[str, str]) -> dict:
    """The files of ``stack`` merged the simple way compose does for these files (services by key)."""
    merged: dict = {"services": {}}
    for name in STACKS[stack][0]:
        doc = yaml.safe_load(interpolate((COMPOSE / name).read_text(), env))
        for service, spec in doc.get("services", {}).items():
            base = merged["services"].setdefault(service, {})
            for key, value in spec.items():
                if isinstance(value, list) and isinstance(base.get(key), list):
                    base[key] = base[key] + value
                else:
                    base[key] = value
        for key in ("volumes", "networks"):
            merged.setdefault(key, {}).update(doc.get(key) or {})
    return merged


def stack_env(stack: str) -> dict[str, str]:
    return clean_env(**SECRETS, **STACKS[stack][2])


@pytest.fixture(scope="module", params=sorted(STACKS))
def stack(request):
    return request.param, load_stack(request.param, stack_env(request.param))


# ---- the compose CLI -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STACKS))
def test_compose_config_validates(name):
    if compose_cli() is None:
        pytest.skip("no compose CLI (install Debian's docker-compose or the docker compose plugin)")
    result = render(name, stack_env(name))
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert set(rendered["services"]) == STACKS[name][1]
    for service in WORKER_SERVICES:
        assert rendered["services"][service]["environment"]["PDSERVE_ADMIN_TOKEN"] == SECRETS["PDSERVE_ADMIN_TOKEN"]


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_refuses_to_start_without_secrets(missing):
    if compose_cli() is None:
        pytest.skip("no compose CLI")
    env = stack_env("gpu")
    del env[missing]
    result = render("gpu", env)
    assert result.returncode != 0 and missing in result.stderr


# ---- structure (no CLI needed) ---------------------------------------------------------------


def test_services_and_secrets(stack):
    name, doc = stack
    services = doc["services"]
    assert set(services) == STACKS[name][1]
    for service, spec in services.items():
        assert spec.get("restart") == "unless-stopped", service
        assert spec.get("healthcheck", {}).get("test"), f"{service} has no health check"
    if "redis" in services:
        redis = services["redis"]
        assert "--requirepass" in redis["command"]
        assert redis["command"][redis["command"].index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]
        published = {s for s, spec in services.items() if spec.get("ports")}
        assert published == ({"gateway", "redis"} if name == "head" else {"gateway"})
        if name == "head":  # Redis only on the private address given
            assert services["redis"]["ports"] == ["10.0.0.1:6379:6379"]
    for service in WORKER_SERVICES:
        url = services[service]["environment"]["REDIS_URL"]
        assert url.startswith(f"redis://:{SECRETS['REDIS_PASSWORD']}@")


def test_commands_name_project_modules_and_valid_flags(stack, compose_entrypoint):
    """Each service runs compose/entrypoint.py with one of the project's modules and flags that
    module's own parser accepts, and every PDSERVE_* variable it sets is one the project reads."""
    from common.worker.config import build_parser as worker_parser
    from gateway.config import build_parser as gateway_parser

    known = known_env_names()
    for service, spec in stack[1]["services"].items():
        if service == "redis":
            continue
        assert spec["entrypoint"] == ["python", "/opt/pdserve/compose/entrypoint.py"]
        module, *flags = spec["command"]
        assert module in compose_entrypoint.MODULES and importlib.util.find_spec(module) is not None
        parser = gateway_parser() if module == "gateway" else worker_parser("decode", "test")
        parser.parse_args(flags)  # SystemExit on an unknown flag or a bad role
        unknown = {k for k in spec["environment"] if k.startswith("PDSERVE_")} - known
        assert not unknown, f"{service} sets variables nothing reads: {sorted(unknown)}"


def test_gpu_workers_pinned_and_ucx_configured(stack):
    name, doc = stack
    if name == "cpu":
        for service in WORKER_SERVICES:
            assert doc["services"][service]["environment"]["PDSERVE_DEVICE"] == "cpu"
        return
    for service in WORKER_SERVICES:
        spec = doc["services"][service]
        devices = spec["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        env = spec["environment"]
        assert env["PDSERVE_GPUS"] == "0,1,2,3,4,5,6,7"  # the 8-GPU example: one claimed per worker
        assert "cuda_ipc" in env["UCX_TLS"] and env["PDSERVE_KV_TRANSPORT"] == "ucx"
        assert spec["ipc"] == "host"  # CUDA IPC between containers
        assert "/run/pdserve-locks" in " ".join(spec["volumes"])
    if name == "workers":
        assert "rc" in doc["services"]["decode"]["environment"]["UCX_TLS"].split(",")
        assert doc["services"]["decode"]["network_mode"] == "host"
        assert doc["services"]["decode"]["environment"]["PDSERVE_ADVERTISE_HOST"] == "10.0.0.2"


def test_dockerfiles_copy_what_exists():
    built = {spec["build"]["dockerfile"] for stack in STACKS
             for spec in load_stack(stack, stack_env(stack))["services"].values() if "build" in spec}
    assert built == {"compose/Dockerfile.gpu", "compose/Dockerfile.cpu"}
    for dockerfile in built:
        text = (ROOT / dockerfile).read_text()
        for line in text.splitlines():
            if line.startswith("COPY "):
                *sources, _dest = line.split()[1:]
                for source in sources:
                    assert (ROOT / source).exists(), f"{dockerfile}: COPY {source} does not exist"
        assert 'ENTRYPOINT ["python", "/opt/pdserve/compose/entrypoint.py"]' in text
    assert "flash-attn" in (COMPOSE / "Dockerfile.gpu").read_text()
    assert "ucxx" in (COMPOSE / "Dockerfile.gpu").read_text()


def test_every_variable_is_documented_in_env_example():
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.M))
    used = set()
    for path in COMPOSE.glob("docker-compose*.yml"):
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]+)", path.read_text()))
    assert used - documented == set(), "undocumented variables"
    assert documented - used == set(), "documented variables no compose file reads"


def test_scale_matches_the_compose_services():
    from gateway.pdctl import scale_command

    for name in ("docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.workers.yml"):
        services = yaml.safe_load((COMPOSE / name).read_text())["services"]
        cmd = scale_command(2, 3, f"compose/{name}")
        scaled = {arg.split("=")[0] for arg in cmd if "=" in arg}
        assert scaled <= set(services) and scaled == {"prefill", "decode"}


# ---- the entrypoint ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_entrypoint():
    spec = importlib.util.spec_from_file_location("compose_entrypoint", COMPOSE / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def known_env_names() -> set[str]:
    """PDSERVE_* names the worker flags, the gateway and the entrypoint read."""
    from common.worker.config import build_parser
    from gateway.config import env_names as gateway_env_names

    names = {f"PDSERVE_{a.dest.upper()}" for a in build_parser("decode", "x")._actions if a.dest != "help"}
    names |= gateway_env_names()
    names |= set(re.findall(r"PDSERVE_[A-Z_]+", (COMPOSE / "entrypoint.py").read_text()))
    return names


def test_gpu_claims_are_exclusive_and_visible_devices_put_the_claim_first(tmp_path, compose_entrypoint):
    ep = compose_entrypoint
    gpus = ["0", "1", "2"]
    held = [ep.claim_gpu(gpus, tmp_path) for _ in gpus]
    assert [slot for slot, _fd in held] == [0, 1, 2]
    with pytest.raises(SystemExit, match="every GPU"):
        ep.claim_gpu(gpus, tmp_path)
    os.close(held[1][1])  # that worker exited: its GPU is free again
    slot, fd = ep.claim_gpu(gpus, tmp_path)
    assert slot == 1
    for _slot, other in (held[0], held[2], (slot, fd)):
        os.close(other)
    assert ep.visible_devices(["4", "5", "6"], 1, isolate=False) == "5,4,6"
    assert ep.visible_devices(["4", "5", "6"], 1, isolate=True) == "5"


def test_prepare_sets_ports_address_and_health_url(tmp_path, monkeypatch, compose_entrypoint):
    ep = compose_entrypoint
    monkeypatch.setattr(ep, "HEALTH_FILE", tmp_path / "health")
    env = {"PDSERVE_GPUS": "0,1", "PDSERVE_LOCK_DIR": str(tmp_path / "locks"), "PDSERVE_PORT_BASE": "9100"}
    first = ep.prepare("decode_svc", env)
    env2 = {"PDSERVE_GPUS": "0,1", "PDSERVE_LOCK_DIR": str(tmp_path / "locks"), "PDSERVE_ADVERTISE_HOST": "h2"}
    second = ep.prepare("prefill_svc", env2)
    try:
        assert (env["PDSERVE_PORT"], env["PDSERVE_KV_PORT"], env["CUDA_VISIBLE_DEVICES"]) == ("9100", "8200", "0,1")
        assert (env2["PDSERVE_PORT"], env2["PDSERVE_KV_PORT"], env2["CUDA_VISIBLE_DEVICES"]) == ("8101", "8201", "1,0")
        assert env["PDSERVE_HOST"] == "0.0.0.0" and env["PDSERVE_ADVERTISE_HOST"]  # this container's address
        assert env2["PDSERVE_ADVERTISE_HOST"] == "h2"
        assert env2["PDSERVE_WORKER_ID"].endswith("-gpu1")
        assert (tmp_path / "health").read_text().strip() == "http://127.0.0.1:8101/health"
    finally:
        os.close(first)
        os.close(second)
    gw = {"PDSERVE_GATEWAY_PORT": str(free_port())}
    assert ep.prepare("gateway", gw) is None
    assert gw["PDSERVE_GATEWAY_HOST"] == "0.0.0.0" and "CUDA_VISIBLE_DEVICES" not in gw
    assert ep.health() == 1  # nothing listens on the gateway port here
