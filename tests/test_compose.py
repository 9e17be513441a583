"""compose/: every file set renders with the real compose CLI for each profile, and the rendered
files keep the deployment's promises (distinct projects, bounded logs, ulimits, stop grace over
the drain, no published worker port, head files without workers, external model cache, no
secrets in the build context, a dashboard whose metrics exist).

The CLI is ``docker compose`` v2 or Debian's ``docker-compose`` 1.29 (CI installs it); without one
the same checks run on the files as this module interpolates and merges them.  No Docker engine
is needed: ``config`` only parses and interpolates.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from common.cluster.launcher import ROOT
from gateway.ops.env_file import SHARED_SECRETS, STACKS as STACK_PROJECTS, build_env, write_env_file

COMPOSE = ROOT / "compose"
ENV_EXAMPLE = COMPOSE / ".env.example"
WORKER_SERVICES = ("prefill", "decode")
# file set -> (compose files, host settings its env file needs, profiles it offers)
STACKS = {
    "gpu": (["docker-compose.yml"], {"PDSERVE_MODEL": "hf:org/model"}, ("monitoring", "tls")),
    "cpu": (["docker-compose.cpu.yml"], {}, ("monitoring", "tls")),
    "head": (["docker-compose.yml", "docker-compose.head.yml"],
             {"PDSERVE_MODEL": "hf:org/model", "REDIS_BIND_ADDR": "10.0.0.1"}, ("monitoring", "tls")),
    "workers": (["docker-compose.workers.yml", "docker-compose.rdma.yml"],
                {"PDSERVE_MODEL": "hf:org/model", "REDIS_HOST": "10.0.0.1", "HOST_ADDR": "10.0.0.2"}, ("monitoring",)),
}
PROFILED = {"monitoring": {"metrics-sd", "prometheus", "grafana", "dcgm-exporter"}, "tls": {"tls"}}
BASE_SERVICES = {"gpu": {"redis", "gateway", "prefill", "decode"}, "cpu": {"redis", "gateway", "prefill", "decode"},
                 "head": {"redis", "gateway", "prefill", "decode"}, "workers": {"prefill", "decode"}}
GATEWAY_SHUTDOWN_MARGIN_S = 10
WORKER_STOP_MARGIN_S = 15


def compose_cli() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        if subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def profile_sets(stack: str) -> list[tuple[str, ...]]:
    """No profile, and every profile at once (each profile only adds its own services)."""
    return [(), STACKS[stack][2]]


def expected_services(stack: str, profiles: tuple[str, ...]) -> set[str]:
    services = set(BASE_SERVICES[stack])
    for profile in profiles:
        services |= PROFILED[profile]
    if stack == "cpu":
        services.discard("dcgm-exporter")
    if stack == "workers":
        services &= {"prefill", "decode", "dcgm-exporter"}
    return services


@pytest.fixture(scope="module")
def env_files(tmp_path_factory):
    """One env file per file set, written by `pdctl gen-secrets`' own code."""
    root = tmp_path_factory.mktemp("env")
    return {stack: write_env_file(root / f"{stack}.env", build_env(stack, settings=STACKS[stack][1])) for stack in STACKS}


def env_values(env_files, stack: str) -> dict[str, str]:
    from gateway.ops.env_file import read_env_file

    return read_env_file(env_files[stack])


def clean_env() -> dict[str, str]:
    """The test process's environment minus anything the compose files read."""
    import os

    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PDSERVE_", "REDIS_", "UCX_", "HOST_ADDR", "COMPOSE_", "HF_", "GRAFANA_"))}


def active(doc: dict, profiles) -> dict:
    """``doc`` with only the services ``up`` would start under ``profiles`` (compose 1.29's
    ``config`` prints every service, v2's only the active ones)."""
    doc["services"] = {s: spec for s, spec in doc["services"].items()
                       if not spec.get("profiles") or set(spec["profiles"]) & set(profiles)}
    return doc


def render_cli(stack: str, env_file, profiles=(), drop: str | None = None) -> subprocess.CompletedProcess:
    args = [arg for name in STACKS[stack][0] for arg in ("-f", str(COMPOSE / name))]
    args += [arg for p in profiles for arg in ("--profile", p)]
    if drop:  # an env file without one variable
        text = "\n".join(line for line in env_file.read_text().splitlines() if not line.startswith(f"{drop}="))
        env_file = env_file.with_name(f"without-{drop}.env")
        env_file.write_text(text + "\n")
    return subprocess.run([*compose_cli(), "--env-file", str(env_file), *args, "config"],
                          capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=60)


# ---- interpolation and merging without the CLI (the structural path) ---------------------------


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ (enough for these files)."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":?" and not value:
            raise KeyError(f"{name}: {arg}")
        if op == ":-" and not value:
            return arg
        return value or ""

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", sub, text)


def merge(base, override):
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return override


def load_stack(stack: str, env: dict[str, str], profiles=()) -> dict:
    """The files of ``stack`` merged the way compose merges them (mappings deeply, lists appended)."""
    merged: dict = {}
    for name in STACKS[stack][0]:
        doc = yaml.safe_load(interpolate((COMPOSE / name).read_text(), env))
        doc = {k: v for k, v in doc.items() if not k.startswith("x-")}
        merged = merge(merged, doc)
    for spec in merged.get("services", {}).values():  # compose passes environment values as strings
        if isinstance(spec.get("environment"), dict):
            spec["environment"] = {k: v if v is None else str(v) for k, v in spec["environment"].items()}
    return active(merged, profiles)


@pytest.fixture(scope="module")
def rendered(env_files):
    """(stack, profiles) -> the configuration: the CLI's rendering when a CLI exists, else ours."""
    cli = compose_cli()
    out = {}
    for stack in STACKS:
        for profiles in profile_sets(stack):
            if cli:
                result = render_cli(stack, env_files[stack], profiles)
                assert result.returncode == 0, f"{stack} {profiles}: {result.stderr}"
                out[stack, profiles] = active(yaml.safe_load(result.stdout), profiles)
            else:
                out[stack, profiles] = load_stack(stack, env_values(env_files, stack), profiles)
    return out


def every_rendering(rendered):
    return [(key, doc) for key, doc in rendered.items()]


def seconds(value) -> float:
    text = str(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", text)
    if not parts:
        return float(text)
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


# ---- the compose CLI ---------------------------------------------------------------------------


def test_every_file_set_renders_for_every_profile(rendered):
    if compose_cli() is None:
        pytest.skip("no compose CLI (install Debian's docker-compose or the docker compose plugin); "
                    "the structural tests below still run")
    for stack in STACKS:
        for profiles in profile_sets(stack):  # the fixture asserted that the CLI accepted each
            assert set(rendered[stack, profiles]["services"]) == expected_services(stack, profiles), (stack, profiles)


@pytest.mark.parametrize("missing", ["PDSERVE_CLUSTER_SECRET", "REDIS_PASSWORD", "COMPOSE_PROJECT_NAME",
                                     "PDSERVE_MODEL"])
def test_compose_refuses_to_start_without_the_env_file_values(missing, env_files):
    if compose_cli() is None:
        pytest.skip("no compose CLI")
    result = render_cli("gpu", env_files["gpu"], drop=missing)
    assert result.returncode != 0 and missing in result.stderr


# ---- rendered-file checks (CLI output, or the structural rendering) ------------------------------


def test_each_file_set_has_its_own_project_name(rendered):
    names = {}
    for (stack, _profiles), doc in rendered.items():
        labels = {s: (spec.get("labels") or {}).get("com.pdserve.project") for s, spec in doc["services"].items()}
        assert set(labels.values()) == {STACK_PROJECTS[stack][0]}, (stack, labels)
        if "name" in doc:  # compose v2 prints the project name it resolved
            assert doc["name"] == STACK_PROJECTS[stack][0]
        names[stack] = STACK_PROJECTS[stack][0]
    assert len(set(names.values())) == len(names), names


def test_logs_rotate_and_limits_apply_everywhere(rendered):
    for (stack, profiles), doc in rendered.items():
        for service, spec in doc["services"].items():
            logging = spec.get("logging") or {}
            assert logging.get("driver") == "json-file", (stack, service)
            assert logging["options"]["max-size"] and int(logging["options"]["max-file"]) >= 1, (stack, service)
            assert spec["deploy"]["resources"]["limits"]["memory"], (stack, service, "no memory limit")
            if service in ("gateway", "redis", "tls", *WORKER_SERVICES):
                nofile = spec["ulimits"]["nofile"]
                assert int(nofile["soft"]) >= 65536 and int(nofile["hard"]) >= 65536, (stack, service)


def test_stop_grace_covers_the_drain(rendered):
    from aiohttp import web

    aiohttp_shutdown = inspect.signature(web.BaseRunner.__init__).parameters["shutdown_timeout"].default
    assert "shutdown_timeout" not in (ROOT / "gateway" / "server.py").read_text()  # the default applies
    for (stack, _profiles), doc in rendered.items():
        for service in WORKER_SERVICES:
            spec = doc["services"][service]
            env = spec["environment"]
            drain = float(env["PDSERVE_DRAIN_TIMEOUT"])
            grace = seconds(spec["stop_grace_period"])
            assert grace >= drain + WORKER_STOP_MARGIN_S, (stack, service, grace, drain)
            assert seconds(env["PDSERVE_STOP_GRACE"]) == grace  # what the entrypoint checks against
        if "gateway" in doc["services"]:
            assert seconds(doc["services"]["gateway"]["stop_grace_period"]) >= aiohttp_shutdown + GATEWAY_SHUTDOWN_MARGIN_S


def test_no_worker_port_is_published_and_head_files_start_no_worker(rendered):
    for (stack, _profiles), doc in rendered.items():
        services = doc["services"]
        for service in WORKER_SERVICES:
            assert not services[service].get("ports"), (stack, service)
            replicas = int(services[service]["deploy"].get("replicas", 1))
            assert "scale" not in services[service]  # 1.29 refuses scale together with deploy.replicas
            if stack == "head":
                assert replicas == 0, "the head file set must start no worker"
            else:
                assert replicas >= 1
        published = {s for s, spec in services.items() if spec.get("ports")}
        assert published <= {"gateway", "redis", "tls", "prometheus", "grafana"}, (stack, published)
        if "redis" in published:
            assert stack == "head"
            ports = services["redis"]["ports"]
            assert all("10.0.0.1" in str(p) for p in ports), ports  # the private address only
        for service in published & {"prometheus", "grafana"}:
            assert all("127.0.0.1" in str(p) for p in services[service]["ports"]), (stack, service)


def test_workers_claim_real_gpus_and_restart_only_on_failure(rendered):
    for (stack, _profiles), doc in rendered.items():
        for service in WORKER_SERVICES:
            spec = doc["services"][service]
            env = spec["environment"]
            assert spec["restart"] == "on-failure", (stack, service)  # surplus replicas exit 0 and stay down
            if stack == "cpu":
                assert env["PDSERVE_DEVICE"] == "cpu" and not env.get("PDSERVE_GPUS")
                continue
            assert env["PDSERVE_DEVICE"] == "cuda", (stack, service)
            devices = spec["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert env["PDSERVE_GPUS"] == "all"
            assert "cuda_ipc" in env["UCX_TLS"] and env["PDSERVE_KV_TRANSPORT"] == "ucx"
            assert "/run/pdserve-locks" in " ".join(str(v) for v in spec["volumes"])
        if "gateway" in doc["services"]:
            assert doc["services"]["gateway"]["restart"] == "unless-stopped"


def test_nics_and_ports_are_pinned_and_tcp_stays_as_fallback(rendered):
    for (stack, _profiles), doc in rendered.items():
        for service in WORKER_SERVICES:
            env = doc["services"][service]["environment"]
            assert env["UCX_NET_DEVICES"] == "auto", (stack, service)  # never "all"
            assert int(env["PDSERVE_UCX_TCP_PORT_BASE"]) > 1024
            if "UCX_TLS" in env:
                assert "tcp" in env["UCX_TLS"].split(","), (stack, service)
        if stack == "workers":
            decode = doc["services"]["decode"]
            assert decode["network_mode"] == "host"
            assert decode["environment"]["PDSERVE_NETWORK_MODE"] == "host"
            assert "rc" in decode["environment"]["UCX_TLS"].split(",")
            assert decode["environment"]["PDSERVE_ADVERTISE_HOST"] == "10.0.0.2"
            assert any("/dev/infiniband" in str(d) for d in decode["devices"]) and "IPC_LOCK" in decode["cap_add"]


def test_models_read_only_and_the_cache_survives_down_v(rendered):
    for (stack, _profiles), doc in rendered.items():
        cache = doc["volumes"]["cache"]
        assert cache.get("external") in (True, {"name": "pdserve-cache"}) or cache.get("external", {}).get("name")
        assert (cache.get("name") or cache["external"].get("name")) == "pdserve-cache"
        for service in (*WORKER_SERVICES, "gateway"):
            if service not in doc["services"]:
                continue
            volumes = doc["services"][service]["volumes"]
            as_text = [v if isinstance(v, str) else f"{v.get('source')}:{v['target']}:{'ro' if v.get('read_only') else 'rw'}"
                       for v in volumes]
            models = [v for v in as_text if ":/models" in v]
            assert models and all(v.endswith(":ro") for v in models), (stack, service, as_text)
            assert any(":/cache" in v for v in as_text)
            assert doc["services"][service]["environment"]["PDSERVE_CACHE"] == "/cache"


def test_gateway_requires_an_api_key_unless_opted_out(rendered):
    for (stack, profiles), doc in rendered.items():
        if "gateway" not in doc["services"]:
            continue
        env = doc["services"]["gateway"]["environment"]
        assert env["PDSERVE_ALLOW_NO_API_KEY"] == "0" and env["PDSERVE_API_KEY"]
        if "tls" in profiles:
            tls = doc["services"]["tls"]
            assert "PDSERVE_ALLOW_NO_API_KEY" in " ".join(tls["entrypoint"])
            assert tls["environment"]["PDSERVE_ALLOW_NO_API_KEY"] == "0"


def test_redis_password_stays_off_the_command_line(rendered):
    for (stack, _profiles), doc in rendered.items():
        redis = doc["services"].get("redis")
        if redis:
            password = redis["environment"]["REDIS_PASSWORD"]
            assert password not in " ".join(redis["command"]) and "requirepass" in " ".join(redis["command"])


# ---- the files themselves ------------------------------------------------------------------------


def test_services_run_project_modules_with_flags_they_accept(env_files, compose_entrypoint):
    """Each pdserve service runs compose/entrypoint.py with one of the project's modules and flags
    that module's own parser accepts, and every PDSERVE_* variable it sets is one the project reads."""
    from common.worker.config import build_parser as worker_parser
    from gateway.config import build_parser as gateway_parser

    known = known_env_names()
    for stack in STACKS:
        doc = load_stack(stack, env_values(env_files, stack), STACKS[stack][2])
        for service, spec in doc["services"].items():
            own_script = " ".join(str(part) for part in [*(spec.get("entrypoint") or []), *(spec.get("command") or [])])
            read_here = set(re.findall(r"\$\{?(PDSERVE_[A-Z_]+)", own_script))  # a shell entrypoint's own checks
            unknown = {k for k in spec.get("environment", {}) if k.startswith("PDSERVE_")} - known - read_here
            assert not unknown, f"{stack}/{service} sets variables nothing reads: {sorted(unknown)}"
            if spec.get("entrypoint") != ["python", "/opt/pdserve/compose/entrypoint.py"]:
                continue
            module, *flags = spec["command"]
            assert module in compose_entrypoint.MODULES and importlib.util.find_spec(module) is not None
            parser = gateway_parser() if module == "gateway" else worker_parser("decode", "test")
            parser.parse_args(flags)  # SystemExit on an unknown flag or a bad role


def test_cpu_file_monitoring_and_tls_match_the_gpu_file():
    gpu = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    cpu = yaml.safe_load((COMPOSE / "docker-compose.cpu.yml").read_text())["services"]
    for service in ("prometheus", "grafana", "tls"):
        assert cpu[service] == gpu[service], service
    assert {k: v for k, v in cpu["metrics-sd"].items() if k not in ("entrypoint", "image", "build")} == \
           {k: v for k, v in gpu["metrics-sd"].items() if k not in ("entrypoint", "image", "build")}
    assert "dcgm-exporter" in gpu and "dcgm-exporter" not in cpu


def test_every_variable_is_documented_and_the_example_has_no_usable_secret():
    from common.cluster.auth import secret_problem
    from gateway.ops.env_file import HOST_SECRETS

    text = ENV_EXAMPLE.read_text()
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", text, re.M))
    used = set()
    for path in COMPOSE.glob("docker-compose*.yml"):
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]+)", path.read_text()))
    assert used - documented == set(), "undocumented variables"
    assert documented - used == set(), "documented variables no compose file reads"
    values = dict(re.findall(r"^([A-Z][A-Z0-9_]+)=(.*)$", text, re.M))
    for key in SHARED_SECRETS + HOST_SECRETS:
        assert key in values and secret_problem(values[key]), f"{key} in .env.example looks usable"


def test_dashboard_uses_metrics_that_exist():
    from prometheus_client import CollectorRegistry

    from common.worker.metrics import WorkerMetrics
    from gateway.metrics import GatewayMetrics

    exposed = set()
    for registry in (GatewayMetrics().registry, WorkerMetrics().registry):
        assert isinstance(registry, CollectorRegistry)
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                        "gauge": ("",)}.get(family.type, ("",))
            exposed |= {family.name + s for s in suffixes}
    dashboard = json.loads((COMPOSE / "monitoring" / "grafana" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(pdserve_[a-z0-9_]+)", e)}
    assert used and used - exposed == set(), f"dashboard queries unknown metrics: {sorted(used - exposed)}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("first token", "inter-token", "throughput", "kv cache usage", "hit rate", "transfer bytes",
                  "transfer time", "queue depth", "gpu utilization"):
        assert topic in titles, topic
    assert any("by (role)" in e for e in exprs)  # per pool
    prometheus = yaml.safe_load((COMPOSE / "monitoring" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["pdserve-workers"]["http_sd_configs"][0]["url"].endswith("/targets/workers")
    assert jobs["dcgm"]["http_sd_configs"][0]["url"].endswith("/targets/dcgm")


def test_mounted_config_files_exist():
    for name in ("docker-compose.yml", "docker-compose.cpu.yml"):
        for spec in yaml.safe_load((COMPOSE / name).read_text())["services"].values():
            for volume in spec.get("volumes", []):
                source = str(volume).split(":")[0]
                if source.startswith("./"):
                    assert (COMPOSE / source).exists(), f"{name}: {source} does not exist"


# ---- images: what the build contexts hold --------------------------------------------------------


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parent
    directories decides; ``!`` re-includes; ``**`` spans directories."""

    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for line in patterns:
        negate = line.startswith("!")
        rx = regex(line[1:] if negate else line)
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def read_dockerignore(path) -> list[str]:
    return [line.strip().lstrip("/") for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_dockerignore_matcher_follows_docker_rules():
    rules = ["**", "!compose/**", "**/*.env"]
    assert dockerignore_excludes(rules, "README.md")
    assert not dockerignore_excludes(rules, "compose/entrypoint.py")
    assert dockerignore_excludes(rules, "compose/head.env")
    assert dockerignore_excludes(["secret"], "secret/inner/file")  # a directory takes its contents


@pytest.mark.parametrize("dockerfile", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_build_contexts_exclude_secrets(dockerfile, tmp_path):
    """A tree holding env files where operators keep them: none reaches the build context, and
    everything the Dockerfile copies does."""
    patterns = read_dockerignore(COMPOSE / f"{dockerfile}.dockerignore")
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, cwd=ROOT).stdout.split()
    secrets = ["compose/.env", "compose/head.env", "compose/workers.env", ".env", "compose/.env.local",
               "gateway/.env", "common/cluster/.env", "compose/tls/server.key", "compose/tls/cert.pem"]
    context = [p for p in tracked + secrets if not dockerignore_excludes(patterns, p)]
    assert not set(secrets) & set(context), f"secrets in the build context: {sorted(set(secrets) & set(context))}"
    assert "compose/.env.example" not in context  # nothing from compose/ but what the image needs
    for line in (COMPOSE / dockerfile).read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _dest = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile}: COPY {source} does not exist"
                assert any(p == source or p.startswith(source.rstrip("/") + "/") for p in context), \
                    f"{dockerfile}: COPY {source} is excluded from the build context"


def test_images_use_the_lock_and_the_gpu_image_is_multi_stage():
    gpu = (COMPOSE / "Dockerfile.gpu").read_text()
    cpu = (COMPOSE / "Dockerfile.cpu").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", gpu, re.M)
    assert len(stages) == 2 and stages[0][1] == "builder"
    assert "devel" in re.search(r"ARG BUILDER_IMAGE=(\S+)", gpu).group(1)
    assert "runtime" in re.search(r"ARG RUNTIME_IMAGE=(\S+)", gpu).group(1)
    assert "! command -v nvcc" in gpu  # the runtime stage proves it has no compiler
    assert "ensure_default_model" not in gpu  # no model baked into the GPU image
    assert "--with-verbs" in gpu and "--with-rdmacm" in gpu and "--with-gdrcopy" in gpu and "--with-cuda" in gpu
    assert "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true" in gpu and "/opt/ucx/bin" in gpu
    assert "rdma-core" in gpu
    for text, locks in ((gpu, ("gpu.lock", "flash-attn.lock", "build.lock")), (cpu, ("cpu.lock", "cpu-torch.lock"))):
        commands = text.replace("\\\n", " ").splitlines()
        installs = [line for line in commands if "pip install" in line]
        for lock in locks:
            assert any(f"requirements/{lock}" in line and "--require-hashes" in line for line in installs), lock
        assert all("--require-hashes" in line or "--no-deps" in line for line in installs)


# ---- the entrypoint ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_entrypoint():
    spec = importlib.util.spec_from_file_location("compose_entrypoint", COMPOSE / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def metrics_proxy_env_names() -> set[str]:
    """What ``pdctl metrics-proxy`` (service metrics-sd) reads: its flags' PDSERVE_<FLAG> names."""
    import argparse

    from common.cluster.flags import EnvFlags
    from gateway.pdctl import build_parser as pdctl_parser

    commands = next(a for a in pdctl_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return EnvFlags(commands.choices["metrics-proxy"], {}).names()


def known_env_names() -> set[str]:
    """PDSERVE_* names the worker flags, the gateway, the model cache and the entrypoint read."""
    from common.cluster.auth import SECRET_ENV
    from common.worker.config import build_parser
    from gateway.config import env_names as gateway_env_names

    names = {f"PDSERVE_{a.dest.upper()}" for a in build_parser("decode", "x")._actions if a.dest != "help"}
    names |= gateway_env_names() | {SECRET_ENV} | metrics_proxy_env_names()
    for path in (COMPOSE / "entrypoint.py", COMPOSE / "net_devices.py", ROOT / "common" / "engine" / "default_model.py",
                 COMPOSE / "tls" / "Caddyfile"):
        names |= set(re.findall(r"PDSERVE_[A-Z_]+", path.read_text()))
    return names


# ---- what faces the network: the gateway's plain port, the TLS front, worker binds, metrics ------------


def published_addresses(spec: dict) -> list[str]:
    """The host addresses a service's ports are published on (``0.0.0.0`` when none is named):
    compose 1.29 prints ``IP:HOST:CONTAINER/tcp``, v2 a mapping with ``host_ip``."""
    out = []
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            out.append(port.get("host_ip") or "0.0.0.0")
        else:
            parts = str(port).split(":")
            out.append(parts[0] if len(parts) == 3 else "0.0.0.0")
    return out


def test_the_gateways_plain_http_port_is_published_on_loopback_only(rendered):
    for (stack, profiles), doc in rendered.items():
        if "gateway" not in doc["services"]:
            continue
        assert published_addresses(doc["services"]["gateway"]) == ["127.0.0.1"], (stack, profiles)
        if "tls" in profiles:  # the TLS front checks the same setting the port uses
            assert doc["services"]["tls"]["environment"]["PDSERVE_GATEWAY_BIND"] == "127.0.0.1"


def run_service_script(spec: dict, env: dict[str, str], bin_dir, replace: dict[str, str] | None = None):
    """Run a service's ``sh -c`` entrypoint here, with stand-in tools in ``bin_dir``."""
    assert spec["entrypoint"][:2] == ["sh", "-c"]
    script = spec["entrypoint"][2]
    for old, new in (replace or {}).items():
        script = script.replace(old, new)
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})


def stand_in(bin_dir, name: str):
    """An executable ``name`` in ``bin_dir`` that prints its name and arguments and exits 0."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f'#!/bin/sh\necho "{name} ran: $*"\n')
    tool.chmod(0o755)
    return tool


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
def test_the_tls_front_refuses_a_plain_gateway_port_beyond_loopback(env_files, tmp_path):
    tls = load_stack("gpu", env_values(env_files, "gpu"), ("tls",))["services"]["tls"]
    stand_in(tmp_path / "bin", "caddy")
    ok = run_service_script(tls, tls["environment"], tmp_path / "bin")
    assert ok.returncode == 0 and "caddy ran: run --config /etc/caddy/Caddyfile" in ok.stdout, ok.stderr
    for bind in ("0.0.0.0", "10.0.0.5", "gateway.example.com"):
        refused = run_service_script(tls, {**tls["environment"], "PDSERVE_GATEWAY_BIND": bind}, tmp_path / "bin")
        assert refused.returncode == 78 and "caddy ran" not in refused.stdout
        assert f"published on {bind}" in refused.stderr and "PDSERVE_GATEWAY_BIND=127.0.0.1" in refused.stderr
    refused = run_service_script(tls, {**tls["environment"], "PDSERVE_ALLOW_NO_API_KEY": "1"}, tmp_path / "bin")
    assert refused.returncode == 78 and "requires the gateway API key" in refused.stderr


# The paths the gateway serves to clients, and paths that must never reach it from the public
# proxy, in the spellings a client can send (traversal, escapes, case, doubled slashes).
CLIENT_PATHS = ["/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/openapi.json"]
PRIVATE_PATHS = ["/admin/pools", "/admin", "/admin/", "/ADMIN/pools", "//admin/pools", "/admin/workers/w1/drain",
                 "/v1/../admin/pools", "/v1/%2e%2e/admin/pools", "/v1/%2E%2E/admin/pools", "/v1/..%2fadmin/pools",
                 "/v1%2f..%2fadmin/pools", "/%61dmin/pools", "/v1/./../admin/pools", "/health/../admin/pools",
                 "/openapi.json/../admin/pools", "/metrics", "/v1/../metrics", "/Metrics"]


def caddyfile_blocks(text: str) -> list[tuple[list[str], list]]:
    """The Caddyfile as nested (tokens of a line, child blocks) -- enough to see which directives
    sit inside which ``handle``."""
    root: list = []
    stack = [root]
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line == "}":
            stack.pop()
            continue
        opens = line.endswith("{")
        node = (line.rstrip("{").split(), [])
        stack[-1].append(node)
        if opens:
            stack.append(node[1])
    assert len(stack) == 1, "unbalanced braces"
    return root


def test_the_public_proxy_routes_only_the_client_api():
    """Structural check of compose/tls/Caddyfile (the end-to-end test below runs Caddy itself)."""
    (site,) = caddyfile_blocks((COMPOSE / "tls" / "Caddyfile").read_text())
    directives = site[1]
    matchers = {tokens[0]: tokens[1:] for tokens, _ in directives if tokens[0].startswith("@")}
    handles = [(tokens[1:], body) for tokens, body in directives if tokens[0] == "handle"]
    assert not any(tokens[0] == "reverse_proxy" for tokens, _ in directives), "a site-wide reverse_proxy"
    proxied = [m for m, body in handles if any(t[0] == "reverse_proxy" for t, _ in body)]
    assert len(proxied) == 1 and len(proxied[0]) == 1
    matcher = matchers[proxied[0][0]]
    assert matcher[0] == "path" and set(matcher[1:]) == {"/v1/*", "/health", "/openapi.json"}
    fallback = [body for m, body in handles if not m]
    assert fallback and fallback[0][0][0] == ["respond", "404"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("caddy") is None, reason="no caddy binary (Debian: apt-get install caddy)")
def test_caddy_sends_only_client_api_paths_to_the_gateway(tmp_path):
    """The real Caddy, with the Caddyfile as compose mounts it (TLS swapped for plain HTTP on a local
    port), in front of a stand-in gateway that records every path it receives."""
    import http.client
    import http.server
    import socket
    import threading
    import time

    received: list[str] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            received.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "8")
            self.end_headers()
            self.wfile.write(b"gateway\n")

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "PDSERVE_TLS_DOMAIN": "pdserve.test",
           "PDSERVE_TLS_ISSUER": "internal"}
    adapted = subprocess.run(["caddy", "adapt", "--config", str(COMPOSE / "tls" / "Caddyfile"), "--adapter",
                              "caddyfile"], capture_output=True, text=True, env=env, timeout=60)
    assert adapted.returncode == 0, adapted.stderr
    config = json.loads(adapted.stdout)
    port = free_port()
    config["admin"] = {"disabled": True}
    config["apps"].pop("tls", None)
    (server,) = config["apps"]["http"]["servers"].values()
    server["listen"] = [f"127.0.0.1:{port}"]
    server["automatic_https"] = {"disable": True}
    text = json.dumps(config).replace('"gateway:8000"', f'"127.0.0.1:{upstream.server_address[1]}"')
    (tmp_path / "caddy.json").write_text(text)
    caddy = subprocess.Popen(["caddy", "run", "--config", str(tmp_path / "caddy.json")], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # a child's readiness is not awaitable: poll its port until the deadline
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert caddy.poll() is None, caddy.stderr.read()
                assert time.monotonic() < deadline, "caddy did not listen"
                time.sleep(0.05)

        def request(path: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)  # the path as written
                conn.putheader("Host", "pdserve.test")
                conn.endheaders()
                return conn.getresponse().status
            finally:
                conn.close()

        for path in PRIVATE_PATHS:
            received.clear()
            status = request(path)
            assert status in (400, 404) and received == [], (path, status, received)
        for path in CLIENT_PATHS:
            received.clear()
            assert request(path) == 200 and received == [path], (path, received)
    finally:
        caddy.terminate()
        caddy.wait(timeout=10)
        upstream.shutdown()


def test_multi_host_workers_listen_on_the_host_address_only(rendered):
    for profiles in profile_sets("workers"):
        services = rendered["workers", profiles]["services"]
        for service in WORKER_SERVICES:
            env = services[service]["environment"]
            assert env["PDSERVE_HOST"] == env["PDSERVE_ADVERTISE_HOST"] == "10.0.0.2", (service, env.get("PDSERVE_HOST"))
            assert not env.get("PDSERVE_KV_HOST")  # KV binds --host too
        if "dcgm-exporter" in services:
            assert services["dcgm-exporter"]["command"] == ["-a", "10.0.0.2:9400"]


def test_the_metrics_proxy_answers_only_prometheus(rendered, env_files, tmp_path):
    prometheus_config = yaml.safe_load((COMPOSE / "monitoring" / "prometheus.yml").read_text())
    token_file = None
    for (stack, profiles), doc in rendered.items():
        if "metrics-sd" not in doc["services"]:
            continue
        services = doc["services"]
        token = env_values(env_files, stack)["PDSERVE_METRICS_TOKEN"]
        assert services["metrics-sd"]["environment"]["PDSERVE_METRICS_TOKEN"] == token
        assert services["prometheus"]["environment"]["PDSERVE_METRICS_TOKEN"] == token
        script = " ".join(services["prometheus"]["entrypoint"])
        token_file = re.search(r"> (/\S+) && exec", script).group(1)
        assert token not in script  # in a file, not on the command line
    assert token_file
    for job in prometheus_config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            if "metrics-sd" in sd["url"]:
                assert sd["authorization"]["credentials_file"] == token_file, job["job_name"]
        if any(sd["url"].endswith("/targets/workers") for sd in job.get("http_sd_configs", [])):
            assert job["authorization"]["credentials_file"] == token_file  # the relayed scrapes too
        if job["job_name"] == "dcgm":
            assert "authorization" not in job  # the exporters themselves get no token


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
def test_prometheus_refuses_a_short_metrics_token_and_keeps_it_off_its_command_line(env_files, tmp_path):
    prometheus = load_stack("gpu", env_values(env_files, "gpu"), ("monitoring",))["services"]["prometheus"]
    fake = stand_in(tmp_path / "bin", "prometheus")
    paths = {"/bin/prometheus": str(fake), "/tmp/metrics-token": str(tmp_path / "token")}
    token = prometheus["environment"]["PDSERVE_METRICS_TOKEN"]
    ran = run_service_script(prometheus, {"PDSERVE_METRICS_TOKEN": token}, tmp_path / "bin", paths)
    assert ran.returncode == 0 and "prometheus ran: --config.file=" in ran.stdout and token not in ran.stdout
    assert (tmp_path / "token").read_text() == token
    assert oct((tmp_path / "token").stat().st_mode & 0o777) == "0o600"
    for weak in ("", "short"):
        refused = run_service_script(prometheus, {"PDSERVE_METRICS_TOKEN": weak}, tmp_path / "bin", paths)
        assert refused.returncode == 78 and "set PDSERVE_METRICS_TOKEN" in refused.stderr


def test_each_service_gets_only_the_secrets_it_uses(rendered):
    """Workers take no admin token (the gateway signs its admin calls) and no API key; the metrics
    proxy's token goes to it and Prometheus only; the TLS front holds no secret of the gateway."""
    uses = {"gateway": {"PDSERVE_CLUSTER_SECRET", "PDSERVE_ADMIN_TOKEN", "PDSERVE_API_KEY", "REDIS_URL"},
            "prefill": {"PDSERVE_CLUSTER_SECRET", "REDIS_URL"}, "decode": {"PDSERVE_CLUSTER_SECRET", "REDIS_URL"},
            "metrics-sd": {"PDSERVE_CLUSTER_SECRET", "PDSERVE_ADMIN_TOKEN", "PDSERVE_METRICS_TOKEN"},
            "prometheus": {"PDSERVE_METRICS_TOKEN"}, "tls": set(), "grafana": set(), "dcgm-exporter": set(),
            "redis": {"REDIS_PASSWORD", "REDISCLI_AUTH"}}
    secrets = {"PDSERVE_CLUSTER_SECRET", "PDSERVE_ADMIN_TOKEN", "PDSERVE_API_KEY", "PDSERVE_METRICS_TOKEN", "REDIS_URL",
               "REDIS_PASSWORD", "REDISCLI_AUTH"}
    for (stack, profiles), doc in rendered.items():
        for service, spec in doc["services"].items():
            given = set(spec.get("environment") or {}) & secrets
            assert given <= uses[service], (stack, service, sorted(given - uses[service]))
