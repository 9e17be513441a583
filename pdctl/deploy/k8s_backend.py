"""Workers as pods of the ``k8s/`` Deployments (``pdserve-prefill``, ``pdserve-decode``), for
``pdctl rollout --k8s`` and ``pdctl scale --k8s``, through ``kubectl``.

A pod's worker id is its name (the manifests set ``PDSERVE_WORKER_ID`` from ``metadata.name``).
Removing exactly one pod -- the one the operator drained -- is a scale-down by one with that pod
marked cheapest to delete (``controller.kubernetes.io/pod-deletion-cost``), so its ReplicaSet takes
that pod and creates no replacement; ``ensure`` scales the Deployment back, and the new pod comes
from the current template and image.  (A pod's own ``preStop`` drains it too, so whatever else
deletes a pod -- ``kubectl rollout restart``, a node drain, the autoscaler -- moves its streams on.)
"""
from __future__ import annotations

import json
import shlex
import subprocess

from pdctl.deploy.backends import Replica, Runner, run_command

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = -2147483648  # the annotation is an int32: below every other pod's


def deployment(service: str) -> str:
    return f"pdserve-{service}"


class KubernetesBackend:
    """See the module docstring.  ``kubectl``: the command (with its context/kubeconfig flags)."""

    def __init__(self, namespace: str | None = None, kubectl: str = "kubectl", runner: Runner = run_command):
        self.kubectl = shlex.split(kubectl) + (["--namespace", namespace] if namespace else [])
        self.run = runner

    def _kubectl(self, *args: str) -> str:
        return self.run([*self.kubectl, *args])

    def check(self, services: list[str]) -> None:
        """Fail now, before anything is drained, unless kubectl runs and finds each Deployment."""
        for service in services:
            self._desired(service)

    def _pods(self, service: str) -> list[dict]:
        out = self._kubectl("get", "pods", "--selector", f"app.kubernetes.io/part-of=pdserve,pdserve.dev/pool={service}",
                            "--output", "json")
        return json.loads(out or "{}").get("items", [])

    def replicas(self, service: str) -> list[Replica]:
        replicas = []
        for pod in self._pods(service):
            name = pod["metadata"]["name"]
            running = pod.get("status", {}).get("phase") == "Running" and "deletionTimestamp" not in pod["metadata"]
            replicas.append(Replica(name, service, name, name if running else None, running=running))
        return sorted(replicas, key=lambda r: r.name)

    def _desired(self, service: str) -> int:
        return int(self._kubectl("get", "deployment", deployment(service), "--output", "jsonpath={.spec.replicas}"))

    def remove(self, replica: Replica, grace_s: float) -> None:
        self._kubectl("annotate", "--overwrite", "pod", replica.handle, f"{DELETION_COST}={LOWEST_COST}")
        desired = self._desired(replica.service)
        self._kubectl("scale", f"deployment/{deployment(replica.service)}", f"--replicas={max(0, desired - 1)}")
        try:
            self._kubectl("wait", "--for=delete", f"pod/{replica.handle}", f"--timeout={int(grace_s)}s")
        except subprocess.CalledProcessError as exc:
            if "NotFound" not in (exc.stderr or ""):  # already gone: done
                raise

    def ensure(self, service: str, count: int) -> None:
        self._kubectl("scale", f"deployment/{deployment(service)}", f"--replicas={count}")

    def healthy(self, replica: Replica) -> bool:
        try:
            pod = json.loads(self._kubectl("get", "pod", replica.handle, "--output", "json"))
        except (subprocess.CalledProcessError, ValueError):
            return False
        conditions = pod.get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
