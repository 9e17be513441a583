"""The Kubernetes manifests (``k8s/``): the base and every overlay render (``tests.support.kustomize``)
and validate against a pinned Kubernetes version's schemas (``kubernetes-validate``, strict), and
they make the same promises the compose files make: no secret in a manifest (each comes from a file
of the Secret ``pdctl gen-secrets --k8s`` writes), only the gateway public, probes on everything,
a grace period that covers the preStop drain and the SIGTERM drain, each pool's tensor-parallel
size equal to its GPUs, and only variables and flags the project reads."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from common.cluster.secret_sources import check_secret
from launcher.local_stack import ROOT
from pdctl.deploy.k8s_secret import KEYS, SECRET_NAME
from tests.support.compose_render import entrypoint_module, known_env_names
from tests.support.kustomize import build

K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.31.0"  # the oldest release the manifests promise to run on
BUILDS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
WORKER_PORTS = {8100, 8200, *range(8300, 8316)}
SECRETISH = re.compile(r"SECRET|TOKEN|PASSWORD|API_KEY", re.I)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: build(path) for name, path in BUILDS.items()}


def workloads(docs):
    return [d for d in docs if d["kind"] == "Deployment"]


def containers(doc):
    return doc["spec"]["template"]["spec"]["containers"]


def env(container) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def named(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_manifest_validates_against_the_pinned_schemas(rendered, tmp_path):
    secret = tmp_path / "secrets.yaml"
    subprocess.run([sys.executable, "-m", "pdctl", "gen-secrets", "--k8s", str(secret)], check=True,
                   capture_output=True, cwd=tmp_path, timeout=120)
    docs = [d for docs in rendered.values() for d in docs] + [yaml.safe_load(secret.read_text())]
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises, naming the field
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
                                         "HorizontalPodAutoscaler", "Secret"}


def test_no_secret_is_in_a_manifest_and_each_comes_from_a_mounted_secret_file(rendered):
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict):
                assert doc.get("kind") != "Secret", f"{path}: a Secret belongs in no repository file"
    for name, docs in rendered.items():
        for doc in workloads(docs):
            pod = doc["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in containers(doc):
                mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
                for var, entry in env(c).items():
                    if SECRETISH.search(var) and not var.endswith("_FILE"):
                        pytest.fail(f"{name}/{doc['metadata']['name']}: {var} carries a secret by value")
                    if var.endswith("_FILE") and SECRETISH.search(var):
                        directory, _, key = entry["value"].rpartition("/")
                        source = mounts[directory].get("secret")
                        assert source and source["secretName"] == SECRET_NAME, f"{var}: not from the Secret"
                        assert key in {i["path"] for i in source["items"]} and key in KEYS
                        assert source["defaultMode"] & 0o007 == 0  # not readable by others


def test_only_the_gateway_is_public(rendered):
    for name, docs in rendered.items():
        services = [d for d in docs if d["kind"] == "Service"]
        assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services)
        exposed = {p["port"] for s in services for p in s["spec"]["ports"]}
        assert not exposed & WORKER_PORTS, f"{name}: a Service exposes a worker port"
        for doc in workloads(docs):
            pod = doc["spec"]["template"]["spec"]
            assert not pod.get("hostNetwork") and all("hostPort" not in p for c in containers(doc)
                                                        for p in c.get("ports", []))
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        deny = named(docs, "NetworkPolicy", "pdserve-default-deny")
        assert deny["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "pdserve"}
        assert "ingress" not in deny["spec"]
        for policy in policies:
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule["ports"]} | {q for p in rule["ports"] if "endPort" in p
                                                              for q in range(p["port"], p["endPort"] + 1)}
                if "from" not in rule:  # open to anyone: only the gateway's API port
                    assert policy["metadata"]["name"] == "pdserve-gateway-public" and ports == {8000}
                else:
                    assert all(peer["podSelector"]["matchLabels"]["app.kubernetes.io/part-of"] == "pdserve"
                               for peer in rule["from"])
        covered = {p["port"] for pol in policies for r in pol["spec"].get("ingress", []) for p in r["ports"]}
        assert {8100, 8200, 8300, 6379, 8000} <= covered


def test_probes_and_the_grace_period_cover_the_drain(rendered):
    for name, docs in rendered.items():
        for doc in workloads(docs):
            pod = doc["spec"]["template"]["spec"]
            for c in containers(doc):
                assert "readinessProbe" in c and "livenessProbe" in c, f"{name}/{doc['metadata']['name']}"
            labels = doc["spec"]["template"]["metadata"]["labels"]
            if labels.get("app.kubernetes.io/component") != "worker":
                continue
            (c,) = containers(doc)
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            command = c["lifecycle"]["preStop"]["exec"]["command"]
            assert command[:3] == ["python", "/opt/pdserve/compose/entrypoint.py", "--drain"]
            pre_stop_s, drain_s = float(command[3]), float(env(c)["PDSERVE_DRAIN_TIMEOUT"]["value"])
            # preStop waits for idle, then SIGTERM drains whatever is left: both within the grace.
            assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + 30
            assert labels["pdserve.dev/pool"] in ("prefill", "decode")
        budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        assert {b["spec"]["selector"]["matchLabels"].get("pdserve.dev/pool") for b in budgets} >= {"prefill", "decode"}


def test_workloads_run_project_modules_with_flags_and_variables_they_read(rendered):
    from gateway.config import build_parser as gateway_parser
    from worker.config import build_parser as worker_parser

    modules, known = entrypoint_module().MODULES, known_env_names()
    for name, docs in rendered.items():
        for doc in workloads(docs):
            for c in containers(doc):
                unknown = {v for v in env(c) if v.startswith("PDSERVE_")} - known
                assert not unknown, f"{name}/{doc['metadata']['name']} sets variables nothing reads: {sorted(unknown)}"
                if doc["metadata"]["name"] == "pdserve-redis":
                    continue
                module, *flags = c["args"]
                assert module in modules
                (gateway_parser() if module == "gateway" else worker_parser("decode", "test")).parse_args(flags)


def test_overlays_choose_the_device_and_each_pool_its_gpus(rendered):
    for overlay, device in (("cpu", "cpu"), ("gpu", "cuda")):
        workers = [d for d in workloads(rendered[overlay]) if "pdserve.dev/pool" in d["spec"]["template"]["metadata"]["labels"]]
        tp = {}
        for doc in workers:
            (c,) = containers(doc)
            variables = env(c)
            assert variables["PDSERVE_DEVICE"]["value"] == device  # the entrypoint refuses "auto"
            assert c["image"] == f"pdserve:{overlay}"
            gpus = c["resources"]["limits"].get("nvidia.com/gpu", 0)
            size = int(variables["PDSERVE_TENSOR_PARALLEL_SIZE"]["value"])
            if device == "cuda":
                assert gpus == size == c["resources"]["requests"]["nvidia.com/gpu"]
            else:
                assert gpus == 0
            tp[doc["spec"]["template"]["metadata"]["labels"]["pdserve.dev/pool"]] = size
            assert len([v for v in c.get("env", []) if v["name"] == "PDSERVE_TENSOR_PARALLEL_SIZE"]) == 1
        if device == "cuda":
            assert tp == {"prefill": 1, "decode": 2}  # the pools may differ


def test_the_autoscaler_reads_a_metric_the_gateway_exports(rendered):
    from gateway.metrics import GatewayMetrics

    hpa = named(rendered["base"], "HorizontalPodAutoscaler", "pdserve-decode")
    metric = hpa["spec"]["metrics"][0]["object"]["metric"]["name"]
    assert metric.encode() in GatewayMetrics().render()[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pdserve-decode"


def test_gen_secrets_writes_a_private_secret_with_strong_fresh_values(tmp_path):
    def generate(path, *extra):
        return subprocess.run([sys.executable, "-m", "pdctl", "gen-secrets", "--k8s", str(path), *extra],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)

    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert generate(first, "--namespace", "serving").returncode == 0 and generate(second).returncode == 0
    assert os.stat(first).st_mode & 0o777 == 0o600
    a, b = yaml.safe_load(first.read_text()), yaml.safe_load(second.read_text())
    assert a["metadata"] == {"name": SECRET_NAME, "namespace": "serving", "labels": {"app.kubernetes.io/part-of": "pdserve"}}
    assert set(a["stringData"]) == set(KEYS)
    for key, value in a["stringData"].items():
        check_secret(value.strip(), key)  # raises on a weak or placeholder value
        assert value != b["stringData"][key]
    refused = generate(first)
    assert refused.returncode == 1 and "--force" in refused.stderr  # the secrets in use are kept
    assert all(v not in refused.stdout + refused.stderr for v in a["stringData"].values())


def test_worker_threads_match_their_cpus_and_gpu_pods_pin_nothing(rendered):
    """A pod's OpenMP threads are its CPUs (the limit, else the request), shared by its tensor-parallel
    ranks (a process each).  GPU pods do not pin: the entrypoint's pinning divides a NUMA node among
    the GPUs it sees, and a pod sees only its own, so pods on one node would pin to the same CPUs."""
    for overlay in ("cpu", "gpu"):
        for doc in workloads(rendered[overlay]):
            if "pdserve.dev/pool" not in doc["spec"]["template"]["metadata"]["labels"]:
                continue
            (c,) = containers(doc)
            variables, resources = env(c), c["resources"]
            cpus = resources.get("limits", {}).get("cpu") or resources["requests"]["cpu"]
            where = f"{overlay}/{doc['metadata']['name']}"
            ranks = int(variables["PDSERVE_TENSOR_PARALLEL_SIZE"]["value"])
            assert int(variables["OMP_NUM_THREADS"]["value"]) * ranks == int(cpus), where
            if overlay == "gpu":
                assert variables["PDSERVE_CPU_PINNING"]["value"] == "off", where
                assert variables["PDSERVE_NUMA_BIND"]["value"] == "off", where


def ingress_routes(path: str, rules) -> bool:
    """Whether an Ingress with ``rules`` sends ``path`` on (Kubernetes' Exact and Prefix matching)."""
    for rule in rules:
        for p in rule["http"]["paths"]:
            if p["pathType"] == "Exact" and path == p["path"]:
                return True
            prefix = p["path"].rstrip("/")
            if p["pathType"] == "Prefix" and (path == prefix or path.startswith(prefix + "/")):
                return True
    return False


def test_the_example_ingress_routes_only_the_client_api(rendered):
    """k8s/ingress: /admin/* and /metrics share the gateway's port with the client API; the Ingress
    the README points to sends on only /v1/*, /health and /openapi.json (SECURITY.md)."""
    docs = build(K8S / "ingress")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    (ingress,) = docs
    service = named(rendered["base"], "Service", "pdserve-gateway")
    for rule in ingress["spec"]["rules"]:
        for p in rule["http"]["paths"]:
            assert p["backend"]["service"] == {"name": service["metadata"]["name"],
                                               "port": {"number": service["spec"]["ports"][0]["port"]}}
    routes = re.findall(r'add_(?:get|post)\("(/[^"]*)"', (ROOT / "gateway" / "server.py").read_text())
    assert {"/admin/pools", "/metrics", "/v1/chat/completions", "/health"} <= set(routes)
    for route in routes:
        public = route.startswith("/v1/") or route in ("/health", "/openapi.json")
        assert ingress_routes(route, ingress["spec"]["rules"]) == public, route
    assert "k8s/ingress" in (K8S / "README.md").read_text()
