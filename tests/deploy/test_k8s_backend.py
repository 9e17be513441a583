"""``pdctl rollout --k8s`` / ``scale --k8s`` (``pdctl.deploy.k8s_backend``): the operator's drain-first
orchestration over pods of the ``k8s/`` Deployments.  ``kubectl`` is a simulated cluster here (a
Deployment's ReplicaSet: scaling down deletes the pods with the lowest deletion cost, scaling up
creates fresh pods from the template), and the admin API a registry the pods join when they start:
so the tests check that exactly the drained pod goes, no replacement takes its place on a
scale-down, and a rollout brings each pool back to its size with new pods."""
from __future__ import annotations

import itertools
import json
import subprocess

import pytest

from pdctl.deploy.k8s_backend import DELETION_COST, KubernetesBackend
from pdctl.deploy.rollout import Operator


class Cluster:
    """``kubectl`` for two Deployments, as a ``runner`` (the argv it is given -> stdout)."""

    def __init__(self, sizes: dict[str, int]):
        self.serial = itertools.count()
        self.pods: dict[str, dict] = {}
        self.replicas = dict(sizes)
        self.calls: list[list[str]] = []
        for service, n in sizes.items():
            for _ in range(n):
                self._create(service)

    def _create(self, service: str) -> None:
        name = f"pdserve-{service}-{next(self.serial):04d}"
        self.pods[name] = {"metadata": {"name": name, "annotations": {}, "labels": {"pdserve.dev/pool": service}},
                           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}

    def _reconcile(self, service: str) -> None:
        mine = [p for p in self.pods.values() if p["metadata"]["labels"]["pdserve.dev/pool"] == service]
        while len(mine) > self.replicas[service]:  # the ReplicaSet deletes the cheapest first
            victim = min(mine, key=lambda p: int(p["metadata"]["annotations"].get(DELETION_COST, 0)))
            mine.remove(victim)
            del self.pods[victim["metadata"]["name"]]
        for _ in range(self.replicas[service] - len(mine)):
            self._create(service)

    def __call__(self, cmd: list[str]) -> str:
        self.calls.append(cmd)
        assert cmd[:3] == ["kubectl", "--namespace", "serving"]
        verb, *rest = cmd[3:]
        if verb == "get" and rest[0] == "pods":
            service = rest[2].rsplit("=", 1)[1]
            return json.dumps({"items": [p for p in self.pods.values()
                                         if p["metadata"]["labels"]["pdserve.dev/pool"] == service]})
        if verb == "get" and rest[0] == "deployment":
            return str(self.replicas[rest[1].removeprefix("pdserve-")])
        if verb == "get" and rest[0] == "pod":
            if rest[1] not in self.pods:
                raise subprocess.CalledProcessError(1, cmd, "", f'Error from server (NotFound): pods "{rest[1]}"')
            return json.dumps(self.pods[rest[1]])
        if verb == "annotate":
            key, _, value = rest[3].partition("=")
            self.pods[rest[2]]["metadata"]["annotations"][key] = value
            return ""
        if verb == "scale":
            service = rest[0].removeprefix("deployment/pdserve-")
            self.replicas[service] = int(rest[1].removeprefix("--replicas="))
            self._reconcile(service)
            return ""
        if verb == "wait":
            assert rest[0] == "--for=delete" and rest[1].removeprefix("pod/") not in self.pods
            return ""
        raise AssertionError(f"unexpected kubectl call {cmd}")


class Registry:
    """The admin API: every pod of the cluster is a registered worker (its name is its id)."""

    def __init__(self, cluster: Cluster):
        self.cluster, self.states, self.drained = cluster, {}, []
        self.started = itertools.count(1)

    def workers(self):
        out = []
        for name in self.cluster.pods:
            if name not in self.states:
                self.states[name] = ("active", float(next(self.started)))
            role = self.cluster.pods[name]["metadata"]["labels"]["pdserve.dev/pool"]
            state, started = self.states[name]
            out.append({"worker_id": name, "role": role, "state": state, "started_at": started,
                        "heartbeat_at": 0.0, "load": {"num_running": 0, "num_waiting": 0}})
        return out

    def drain(self, worker_id):
        self.drained.append(worker_id)
        self.states[worker_id] = ("idle", self.states[worker_id][1])

    def wait_for(self, worker_id, predicate, what, timeout, before):
        entry = next(w for w in self.workers() if w["worker_id"] == worker_id)
        assert predicate(entry), f"{worker_id} not {what}"
        return entry


@pytest.fixture
def cluster():
    return Cluster({"prefill": 2, "decode": 3})


def operator(cluster):
    backend = KubernetesBackend("serving", runner=cluster)
    return Operator(Registry(cluster), backend, say=lambda _line: None, poll_s=0.0)


def test_scale_down_drains_and_removes_exactly_the_pods_it_names(cluster):
    op = operator(cluster)
    plan = op.plan_scale({"prefill": 2, "decode": 1})
    victims = [r.name for r in plan.remove["decode"]]
    survivor = next(n for n in cluster.pods if "decode" in n and n not in victims)
    op.scale(plan)
    assert sorted(op.client.drained) == sorted(victims)  # drained first ...
    assert [n for n in cluster.pods if "decode" in n] == [survivor]  # ... then exactly those removed
    assert cluster.replicas == {"prefill": 2, "decode": 1}
    assert [e for e in op.events if e[0] == "drain"] and all(e[0] != "ready" for e in op.events)


def test_rollout_replaces_each_pod_by_a_fresh_one_and_keeps_the_pool_size(cluster):
    op = operator(cluster)
    before = set(cluster.pods)
    replaced = op.rollout(["decode"])
    assert [old.name for old, _ in replaced] == sorted(n for n in before if "decode" in n)
    assert {new.name for _, new in replaced}.isdisjoint(before)
    assert cluster.replicas["decode"] == 3 and len([n for n in cluster.pods if "decode" in n]) == 3
    assert {n for n in cluster.pods if "prefill" in n} == {n for n in before if "prefill" in n}  # untouched
    # each old pod drained, removed, and its replacement ready before the next one is touched
    kinds = [e[0] for e in op.events]
    assert kinds == ["drain", "idle", "removed", "ready"] * 3


def test_scale_up_creates_pods_and_waits_until_they_serve(cluster):
    op = operator(cluster)
    op.scale(op.plan_scale({"prefill": 4, "decode": 3}))
    assert len([n for n in cluster.pods if "prefill" in n]) == 4 and not op.client.drained
    assert [e[0] for e in op.events] == ["ready", "ready"]


def test_replicas_and_health_come_from_the_pods(cluster):
    backend = KubernetesBackend("serving", runner=cluster)
    name = next(iter(cluster.pods))
    cluster.pods[name]["status"]["conditions"][0]["status"] = "False"
    cluster.pods[name]["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    replicas = {r.name: r for r in backend.replicas("prefill")}
    assert not replicas[name].running and replicas[name].worker_id is None
    assert not backend.healthy(replicas[name])
    other = next(r for r in replicas.values() if r.name != name)
    assert other.running and other.worker_id == other.name and backend.healthy(other)
    gone = type(other)("pdserve-prefill-gone", "prefill", "pdserve-prefill-gone")
    assert not backend.healthy(gone)
