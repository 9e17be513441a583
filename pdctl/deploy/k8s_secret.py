"""``pdctl gen-secrets --k8s FILE``: the Secret every pdserve workload of a Kubernetes deployment
mounts (``k8s/``), with fresh values, written with mode 0600.

The workloads read each secret from a file of this Secret (``PDSERVE_CLUSTER_SECRET_FILE``,
``PDSERVE_ADMIN_TOKEN_FILE``, ``PDSERVE_API_KEYS_FILE``, ``PDSERVE_REDIS_PASSWORD_FILE``), never
from a value in a manifest; the manifests in the repository hold none.
"""
from __future__ import annotations

import json

from common.cluster.auth import SECRET_ENV

SECRET_NAME = "pdserve-secrets"
# Secret key -> the env-file value it holds (pdctl.deploy.env_file.new_secrets).
KEYS = {"cluster-secret": SECRET_ENV, "admin-token": "PDSERVE_ADMIN_TOKEN", "api-keys": "PDSERVE_API_KEY",
        "redis-password": "REDIS_PASSWORD", "metrics-token": "PDSERVE_METRICS_TOKEN"}


def secret_manifest(values: dict[str, str], namespace: str | None = None) -> str:
    """The Secret as YAML (JSON is YAML: every value quoted exactly)."""
    data = {key: values[name] + ("\n" if key == "api-keys" else "") for key, name in KEYS.items()}
    metadata = {"name": SECRET_NAME, "labels": {"app.kubernetes.io/part-of": "pdserve"}}
    if namespace:
        metadata["namespace"] = namespace
    manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "stringData": data}
    return ("# pdserve secrets (pdctl gen-secrets --k8s). Keep this file mode 0600 and out of version control;\n"
            "# kubectl apply -f it once, then delete it or keep it in a secret store.\n"
            + json.dumps(manifest, indent=2) + "\n")
