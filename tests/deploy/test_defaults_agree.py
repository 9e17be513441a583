"""One declaration per setting: ``make up``, every compose stack and the capacity planner resolve the
same engine and KV-transfer defaults, from ``common.engine.config`` and ``kvtransfer.config``.

Each side is resolved the way it runs: the launcher's flags and the worker command line it builds
(``make up``); the compose files rendered, each worker service's environment and command parsed by
the worker's own flags (an unset ``PDSERVE_*`` variable reaches the worker empty, meaning unset);
the planner's flags for a GPU profile and for a calibration measured on CPU workers.
"""
from __future__ import annotations

import json

import pytest
import yaml

from common.engine.config import EngineConfig, scheduling_defaults
from kvtransfer.config import KV_DEFAULTS, default_transport
from launcher.run import build_parser as launcher_parser, stack_from_args
from pdctl.planner.cli import build_config
from pdctl.cli import build_parser as pdctl_parser
from tests.support.compose_render import (
    STACKS, WORKER_SERVICES, compose_cli, env_files, env_values, load_stack, render_cli,
)
from worker.config import build_parser as worker_parser

def resolved(args, device_type: str) -> dict:
    """What a worker decides from its flags and the device it runs on."""
    engine = EngineConfig(model="m", block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs).for_device(device_type)
    return {"max_num_batched_tokens": engine.max_num_batched_tokens, "max_num_seqs": engine.max_num_seqs,
            "block_size": engine.block_size, "kv_transport": args.kv_transport, "kv_timeout": args.kv_timeout}


def declared(device_type: str) -> dict:
    """The declarations themselves."""
    batch = scheduling_defaults(device_type)
    return {"max_num_batched_tokens": batch.max_num_batched_tokens, "max_num_seqs": batch.max_num_seqs,
            "block_size": EngineConfig.block_size, "kv_transport": default_transport(),
            "kv_timeout": KV_DEFAULTS.transfer_timeout}


def make_up_worker_args(role: str):
    """The flags ``make up``'s worker of ``role`` parses, in a clean environment."""
    stack = stack_from_args(launcher_parser(env={}).parse_args([]), "redis://127.0.0.1:6379/0")
    module, argv = stack.worker_command(f"{role}-0", role, 9999)
    assert module == f"{role}_svc"
    return worker_parser(role, "pdserve worker", env={}).parse_args(argv)


@pytest.mark.parametrize("role", WORKER_SERVICES)
def test_make_up_runs_the_declared_defaults(role):
    assert resolved(make_up_worker_args(role), "cpu") == declared("cpu")


def compose_workers():
    """Each stack's worker services as compose renders them (the profiles add other services)."""
    files = env_files()
    for stack in STACKS:
        if compose_cli():
            result = render_cli(stack, files[stack])
            assert result.returncode == 0, f"{stack}: {result.stderr}"
            doc = yaml.safe_load(result.stdout)
        else:
            doc = load_stack(stack, env_values(files, stack))
        for service in WORKER_SERVICES:
            yield stack, (), service, doc["services"][service]


# What a compose file set chooses on purpose where ``make up`` takes the default (its Kubernetes
# counterpart chooses the same: K8S_COUNTERPARTS below).
COMPOSE_CHOICES = {"cpu": {"kv_transport": "tcp"}}


def test_every_compose_worker_resolves_what_make_up_resolves_on_its_device():
    seen = set()
    for stack, profiles, service, spec in compose_workers():
        env = {k: "" if v is None else str(v) for k, v in (spec.get("environment") or {}).items()}
        command = list(spec.get("command") or [])
        assert command and command[0] == f"{service}_svc", (stack, service, command)
        args = worker_parser(service, "pdserve worker", env=env).parse_args(command[1:])
        device = env.get("PDSERVE_DEVICE") or "cpu"
        got, chosen = resolved(args, device), COMPOSE_CHOICES.get(stack, {})
        assert got == declared(device) | chosen, (stack, profiles, service)
        if device == "cpu":  # the CPU stack runs what make up runs, but for its choices
            assert got == resolved(make_up_worker_args(service), "cpu") | chosen, (stack, profiles, service)
        seen.add((stack, device))
    assert {device for _stack, device in seen} == {"cpu", "cuda"}, seen


def test_the_planner_simulates_the_declared_defaults(tmp_path):
    gpu = pdctl_parser().parse_args(["plan", "--gpu", "H200", "--model", "llama-3-8b", "--rate", "1"])
    config, _ = build_config(gpu)
    cuda = scheduling_defaults("cuda")
    assert (config.engine.max_num_batched_tokens, config.engine.max_num_seqs) == (cuda.max_num_batched_tokens,
                                                                                  cuda.max_num_seqs)
    assert config.engine.block_size == EngineConfig.block_size

    calibration = tmp_path / "calibration.json"  # measured on a CPU worker that ran its defaults
    calibration.write_text(json.dumps({"cost_model": {"kind": "linear", "coefficients": [1e-3, 1e-5, 0, 0, 0, 0]},
                                       "engine": {}}))
    cpu_args = pdctl_parser().parse_args(["plan", "--calibration", str(calibration), "--num-blocks", "256",
                                          "--model", "llama-3-8b", "--rate", "1"])
    config, _ = build_config(cpu_args)
    cpu = scheduling_defaults("cpu")
    assert (config.engine.max_num_batched_tokens, config.engine.max_num_seqs) == (cpu.max_num_batched_tokens,
                                                                                  cpu.max_num_seqs)
    worker = make_up_worker_args("decode")
    assert resolved(worker, "cpu")["max_num_batched_tokens"] == config.engine.max_num_batched_tokens


# compose file set -> the Kubernetes overlay that runs the same workers, and the worker settings
# that neither the engine nor the worker declares for that device, so each side sets them itself:
# they must set them alike (one value, shown twice).
K8S_COUNTERPARTS = {
    "cpu": ("cpu", ("PDSERVE_NUM_BLOCKS",  # on CPU the cache is sized, not a fraction of the node
                    "PDSERVE_KV_TRANSPORT")),
    "gpu": ("gpu", ("PDSERVE_KV_MEMORY_FRACTION",)),  # the engine's 0.2 is for hosts that share memory
    "workers": ("gpu", ("PDSERVE_KV_MEMORY_FRACTION",)),
}


def k8s_worker_env(overlay: str) -> dict[str, dict[str, str]]:
    """pool -> its worker container's plain environment values, as the overlay renders."""
    from tests.deploy.test_k8s import BUILDS, containers, env, workloads
    from tests.support.kustomize import build

    out = {}
    for doc in workloads(build(BUILDS[overlay])):
        pool = doc["spec"]["template"]["metadata"]["labels"].get("pdserve.dev/pool")
        if pool:
            (c,) = containers(doc)
            out[pool] = {k: str(v["value"]) for k, v in env(c).items() if "value" in v}
    return out


def test_kubernetes_workers_set_what_the_compose_workers_set():
    compose = {(stack, service): {k: "" if v is None else str(v) for k, v in (spec.get("environment") or {}).items()}
               for stack, _profiles, service, spec in compose_workers()}
    for stack, (overlay, names) in K8S_COUNTERPARTS.items():
        pods = k8s_worker_env(overlay)
        assert set(pods) == set(WORKER_SERVICES), overlay
        for service in WORKER_SERVICES:
            for name in names:
                want = compose[(stack, service)].get(name)
                assert want, f"compose {stack}/{service} leaves {name} to a default"
                assert pods[service].get(name) == want, (f"k8s overlay {overlay}/{service}: {name}="
                                                         f"{pods[service].get(name)!r}, compose {stack}: {want!r}")
