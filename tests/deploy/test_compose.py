"""compose/: every file set renders with the real compose CLI for each profile, and the rendered
files keep the deployment's promises (distinct projects, bounded logs, ulimits, stop grace over
the drain, no published worker port, head files without workers, external model cache, no
secrets in the build context, a dashboard whose metrics exist).  How the files are rendered:
``tests/support/compose_render.py``; what faces the network: ``tests/deploy/test_compose_exposure.py``.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import re
import subprocess

import pytest
import yaml

from launcher.local_stack import ROOT
from pdctl.deploy.env_file import SHARED_SECRETS, STACKS as STACK_PROJECTS
from tests.support.compose_render import (
    COMPOSE, ENV_EXAMPLE, STACKS, WORKER_SERVICES, compose_cli, entrypoint_module, env_values, expected_services,
    known_env_names,
    load_stack, profile_sets, render_cli, renderings, seconds,
)
from tests.support.compose_render import env_files as make_env_files

pytestmark = pytest.mark.slow(seconds=11)  # a long file: scheduled by its length (tests/conftest.py)

GATEWAY_SHUTDOWN_MARGIN_S = 10
WORKER_STOP_MARGIN_S = 15


@pytest.fixture(scope="module")
def env_files():
    return make_env_files()


@pytest.fixture(scope="module")
def rendered():
    return renderings()


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
        if stack == "head":  # nothing on the head holds a GPU: the workers' file set runs its own exporter
            for service, spec in services.items():
                devices = ((spec.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices", [])
                if any("gpu" in d.get("capabilities", []) for d in devices):
                    assert int(spec["deploy"].get("replicas", 1)) == 0, f"the head file set starts {service} on its GPUs"
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
            assert "cuda_ipc" in env["UCX_TLS"] and not env["PDSERVE_KV_TRANSPORT"]  # the workers' default: UCX
            assert "/run/pdserve-locks" in " ".join(str(v) for v in spec["volumes"])
        if "gateway" in doc["services"]:
            assert doc["services"]["gateway"]["restart"] == "unless-stopped"


def test_each_pool_sets_its_own_tensor_parallel_size(env_files, tmp_path):
    """PDSERVE_PREFILL_TP / PDSERVE_DECODE_TP reach each pool's workers (the entrypoint claims that
    many GPUs); GPU workers get a /dev/shm for NCCL and NCCL's settings pass through."""
    if compose_cli() is None:
        pytest.skip("no compose CLI")
    for stack in ("gpu", "workers", "cpu"):
        env_file = tmp_path / f"{stack}.env"
        env_file.write_text(env_files[stack].read_text() + "PDSERVE_PREFILL_TP=4\nPDSERVE_DECODE_TP=2\n")
        result = render_cli(stack, env_file)
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        assert services["prefill"]["environment"]["PDSERVE_TENSOR_PARALLEL_SIZE"] == "4", stack
        assert services["decode"]["environment"]["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2", stack
        assert services["decode"]["environment"]["PDSERVE_MODEL"], "the pool's env still merges the common one"
        if stack != "cpu":
            assert "shm_size" in services["decode"] and "NCCL_P2P_LEVEL" in services["decode"]["environment"]


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
    from worker.config import build_parser as worker_parser
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
    for service in ("prometheus", "grafana"):
        assert cpu[service] == gpu[service], service
    assert "tls" not in gpu and "tls" not in cpu  # one override file for both: docker-compose.tls.yml
    assert {k: v for k, v in cpu["metrics-sd"].items() if k not in ("entrypoint", "image", "build")} == \
           {k: v for k, v in gpu["metrics-sd"].items() if k not in ("entrypoint", "image", "build")}
    assert "dcgm-exporter" in gpu and "dcgm-exporter" not in cpu


def test_every_variable_is_documented_and_the_example_has_no_usable_secret():
    from common.cluster.auth import secret_problem
    from pdctl.deploy.env_file import HOST_SECRETS

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

    from worker.metrics import WorkerMetrics
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
    return entrypoint_module()
