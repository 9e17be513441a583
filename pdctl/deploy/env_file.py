"""Per-host compose env files: the project name, the secrets, and host settings (``pdctl gen-secrets``).

Every compose command passes one (``--env-file``).  It names the compose project, so the file
sets of one host (a head that also runs workers) never share containers or volumes, and it holds
the secrets, without which the compose files refuse to start.  Written with mode 0600.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from common.cluster.auth import SECRET_ENV, generate_secret, secret_problem

# file set -> (compose project name, compose files relative to the repository root)
STACKS: dict[str, tuple[str, list[str]]] = {
    "gpu": ("pdserve", ["compose/docker-compose.yml"]),
    "cpu": ("pdserve-cpu", ["compose/docker-compose.cpu.yml"]),
    "head": ("pdserve-head", ["compose/docker-compose.yml", "compose/docker-compose.head.yml"]),
    "workers": ("pdserve-workers", ["compose/docker-compose.workers.yml"]),
}
# Secrets every host of one deployment shares (copied by --from).
SHARED_SECRETS = (SECRET_ENV, "PDSERVE_ADMIN_TOKEN", "PDSERVE_API_KEY", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")
# Secrets of one host's services only (fresh in every file): the metrics proxy's scrape token,
# which only that host's Prometheus presents.
HOST_SECRETS = ("PDSERVE_METRICS_TOKEN",)
STACK_KEY = "PDSERVE_STACK"


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """``KEY=VALUE`` lines (compose's format: no expansion, optional quotes, # comments)."""
    values = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def new_secrets() -> dict[str, str]:
    return {SECRET_ENV: generate_secret(), "PDSERVE_ADMIN_TOKEN": generate_secret(),
            "PDSERVE_API_KEY": "sk-" + secrets.token_urlsafe(32), "REDIS_PASSWORD": secrets.token_hex(24),
            "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(18), "PDSERVE_METRICS_TOKEN": generate_secret()}


def build_env(stack: str, shared: dict[str, str] | None = None, settings: dict[str, str] | None = None) -> dict[str, str]:
    """The values of an env file for ``stack``: its project name, ``shared`` secrets (new ones when
    None) and host ``settings``.  Raises ValueError on an unknown stack or a weak shared secret."""
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r}; expected one of {', '.join(STACKS)}")
    values = {"COMPOSE_PROJECT_NAME": STACKS[stack][0], STACK_KEY: stack}
    fresh = new_secrets()
    if shared is None:
        values.update(fresh)
    else:
        for key in SHARED_SECRETS:
            problem = secret_problem(shared.get(key))
            if problem:
                raise ValueError(f"{key} in the --from file is not usable: {problem}")
            values[key] = shared[key]
        values.update({key: fresh[key] for key in HOST_SECRETS})
    for key, value in (settings or {}).items():
        if key in SHARED_SECRETS + HOST_SECRETS:
            raise ValueError(f"{key} is a secret: generate it, or copy it with --from")
        values[key] = value
    return values


def write_env_file(path: str | os.PathLike, values: dict[str, str], *, force: bool = False) -> Path:
    """Write ``values`` to ``path`` as a compose env file (``write_private_file``)."""
    lines = ["# pdserve compose env file (pdctl gen-secrets). Secrets: keep it mode 0600, never commit it.",
             "# Pass it to every compose command: docker compose --env-file " + str(path) + " -f ...",
             *(f"{key}={value}" for key, value in values.items())]
    return write_private_file(path, "\n".join(lines) + "\n", force=force)


def write_private_file(path: str | os.PathLike, text: str, *, force: bool = False) -> Path:
    """Write ``text`` to ``path`` with mode 0600 (atomically; never over an existing file unless
    ``force``: regenerating the secrets of a running deployment locks every host out)."""
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; its secrets are in use. Pass --force to replace them")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)  # whatever the umask
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
