"""How the compose tests see the file sets: each rendered by the real compose CLI for each profile
(``docker compose`` v2 or Debian's ``docker-compose`` 1.29, which CI installs), or, without one, as
this module interpolates and merges them.  No Docker engine is needed: ``config`` only parses and
interpolates.  Env files come from `pdctl gen-secrets`' own code; both are made once per process."""
from __future__ import annotations

import atexit
import copy
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from launcher.local_stack import ROOT
from pdctl.deploy.env_file import build_env, write_env_file

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
# "Profiles" that are override files: TLS changes the gateway (its plain port must stay on loopback),
# which a compose profile cannot do.
PROFILE_FILES = {"tls": "docker-compose.tls.yml"}
BASE_SERVICES = {"gpu": {"redis", "gateway", "prefill", "decode"}, "cpu": {"redis", "gateway", "prefill", "decode"},
                 "head": {"redis", "gateway", "prefill", "decode"}, "workers": {"prefill", "decode"}}


@functools.cache
def compose_cli() -> list[str] | None:
    """The compose CLI here (``docker compose`` or Debian's ``docker-compose``), asked once."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        if subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


@functools.cache
def entrypoint_module():
    """compose/entrypoint.py, loaded once as the module ``compose_entrypoint`` (not a package)."""
    spec = importlib.util.spec_from_file_location("compose_entrypoint", COMPOSE / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def profile_sets(stack: str) -> list[tuple[str, ...]]:
    """No profile, and every profile at once (each profile only adds its own services)."""
    return [(), STACKS[stack][2]]


def stack_files(stack: str, profiles=()) -> list[str]:
    """The compose files of ``stack`` with ``profiles`` on (the override files among them added)."""
    return [*STACKS[stack][0], *(PROFILE_FILES[p] for p in profiles if p in PROFILE_FILES)]


def expected_services(stack: str, profiles: tuple[str, ...]) -> set[str]:
    services = set(BASE_SERVICES[stack])
    for profile in profiles:
        services |= PROFILED[profile]
    if stack == "cpu":
        services.discard("dcgm-exporter")
    if stack == "workers":
        services &= {"prefill", "decode", "dcgm-exporter"}
    return services


@functools.cache
def env_files() -> dict[str, Path]:
    """One env file per file set, written by `pdctl gen-secrets`' own code (once per test process,
    in a directory removed at exit)."""
    root = Path(tempfile.mkdtemp(prefix="pdserve-compose-env-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return {stack: write_env_file(root / f"{stack}.env", build_env(stack, settings=STACKS[stack][1])) for stack in STACKS}


def env_values(env_files, stack: str) -> dict[str, str]:
    from pdctl.deploy.env_file import read_env_file

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
    args = [arg for name in stack_files(stack, profiles) for arg in ("-f", str(COMPOSE / name))]
    args += [arg for p in profiles if p not in PROFILE_FILES for arg in ("--profile", p)]
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
    for name in stack_files(stack, profiles):
        doc = yaml.safe_load(interpolate((COMPOSE / name).read_text(), env))
        doc = {k: v for k, v in doc.items() if not k.startswith("x-")}
        merged = merge(merged, doc)
    for spec in merged.get("services", {}).values():  # compose passes environment values as strings
        if isinstance(spec.get("environment"), dict):
            spec["environment"] = {k: v if v is None else str(v) for k, v in spec["environment"].items()}
    return active(merged, profiles)


@functools.cache
def _renderings() -> dict:
    cli = compose_cli()
    out = {}
    for stack in STACKS:
        for profiles in profile_sets(stack):
            if cli:
                result = render_cli(stack, env_files()[stack], profiles)
                assert result.returncode == 0, f"{stack} {profiles}: {result.stderr}"
                out[stack, profiles] = active(yaml.safe_load(result.stdout), profiles)
            else:
                out[stack, profiles] = load_stack(stack, env_values(env_files(), stack), profiles)
    return out


def renderings() -> dict:
    """(stack, profiles) -> the configuration: the CLI's rendering when a CLI exists, else ours
    (computed once per test process; each caller gets its own copy)."""
    return copy.deepcopy(_renderings())


def seconds(value) -> float:
    text = str(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", text)
    if not parts:
        return float(text)
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


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


def metrics_proxy_env_names() -> set[str]:
    """What ``pdctl metrics-proxy`` (service metrics-sd) reads: its flags' PDSERVE_<FLAG> names."""
    import argparse

    from common.cluster.flags import EnvFlags
    from pdctl.cli import build_parser as pdctl_parser

    commands = next(a for a in pdctl_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return EnvFlags(commands.choices["metrics-proxy"], {}).names()


def known_env_names() -> set[str]:
    """PDSERVE_* names the worker flags, the gateway, the model cache and the entrypoint read."""
    from common.cluster.auth import SECRET_ENV
    from worker.config import build_parser
    from gateway.config import env_names as gateway_env_names

    names = {f"PDSERVE_{a.dest.upper()}" for a in build_parser("decode", "x")._actions if a.dest != "help"}
    names |= gateway_env_names() | {SECRET_ENV} | metrics_proxy_env_names()
    for path in (COMPOSE / "entrypoint.py", COMPOSE / "net_devices.py", ROOT / "common" / "engine" / "loading" / "default_model.py",
                 COMPOSE / "tls" / "Caddyfile"):
        names |= set(re.findall(r"PDSERVE_[A-Z_]+", path.read_text()))
    return names
