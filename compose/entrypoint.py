"""Container entrypoint for workers and the gateway: claim a GPU, find the address to advertise, exec.

    python compose/entrypoint.py prefill_svc [worker flags...]     # or decode_svc, gateway
    python compose/entrypoint.py --health                          # the compose health check

GPU claim (when ``PDSERVE_GPUS`` lists GPU indexes, e.g. ``0,1,2,3,4,5,6,7``): a replica of a
scaled service (``docker compose up --scale decode=4``) takes the first GPU whose lock file in
``PDSERVE_LOCK_DIR`` (a volume every worker container on the host mounts) it can ``flock``.  The
lock is held by the worker process itself (the descriptor survives ``exec``), so it is released
exactly when the worker exits, and a restarted container claims again.  Slot ``i`` (the position
of the claimed GPU in the list) then gives:

    CUDA_VISIBLE_DEVICES = <claimed>,<the others>   cuda:0 is the claimed GPU, and the peers' GPUs
                                                    stay visible so UCX can use CUDA IPC / NVLink
                           <claimed>                with PDSERVE_GPU_ISOLATION=1 (no CUDA IPC)
    PDSERVE_WORKER_ID    = <hostname>-gpu<claimed>  (unless PDSERVE_WORKER_ID is set)
    PDSERVE_PORT         = PDSERVE_PORT_BASE + i    (unless PDSERVE_PORT is set)
    PDSERVE_KV_PORT      = PDSERVE_KV_PORT_BASE + i (unless PDSERVE_KV_PORT is set)

so replicas sharing the host's network (multi-host deployments) do not collide on ports.

Advertised address (``PDSERVE_ADVERTISE_HOST`` unset): this container's IP address on the compose
network.  A service name would resolve to any replica of the service, and the container id
needs the resolver to know it; the IP is what peers and the gateway can always reach.

Only the standard library: this runs before anything else in the image.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

HEALTH_FILE = Path(os.environ.get("PDSERVE_HEALTH_FILE", "/tmp/pdserve-health-url"))
MODULES = ("prefill_svc", "decode_svc", "gateway")


def claim_gpu(gpus: list[str], lock_dir: Path) -> tuple[int, int]:
    """Lock the first free GPU of ``gpus``; returns (slot, file descriptor holding the lock)."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    for slot, gpu in enumerate(gpus):
        fd = os.open(lock_dir / f"gpu-{gpu}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        return slot, fd
    raise SystemExit(f"entrypoint: every GPU in PDSERVE_GPUS={','.join(gpus)} is taken by another worker "
                     f"(locks in {lock_dir}); scale the services to at most {len(gpus)} workers in all")


def visible_devices(gpus: list[str], slot: int, isolate: bool) -> str:
    claimed = gpus[slot]
    return claimed if isolate else ",".join([claimed] + [g for g in gpus if g != claimed])


def own_address() -> str:
    """This container's address on its network (the source address of a route outwards)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the interface
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def prepare(module: str, env: dict[str, str]) -> int | None:
    """Fill in ``env`` for ``module``; returns the lock descriptor to keep open, if a GPU was claimed."""
    fd = None
    slot = 0
    gpus = [g.strip() for g in env.get("PDSERVE_GPUS", "").split(",") if g.strip()]
    if module != "gateway":
        if gpus:
            slot, fd = claim_gpu(gpus, Path(env.get("PDSERVE_LOCK_DIR", "/run/pdserve-locks")))
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, slot, env.get("PDSERVE_GPU_ISOLATION") == "1")
            env["PDSERVE_GPU"] = gpus[slot]
            # Readable and stable across restarts: <hostname>-gpu<n> (the host's name on the host
            # network, the container id otherwise).  Worker ids are unique only per GPU and host.
            env.setdefault("PDSERVE_WORKER_ID", f"{socket.gethostname()}-gpu{gpus[slot]}")
        env.setdefault("PDSERVE_PORT", str(int(env.get("PDSERVE_PORT_BASE", "8100")) + slot))
        env.setdefault("PDSERVE_KV_PORT", str(int(env.get("PDSERVE_KV_PORT_BASE", "8200")) + slot))
        env.setdefault("PDSERVE_HOST", "0.0.0.0")
        if not env.get("PDSERVE_ADVERTISE_HOST"):
            env["PDSERVE_ADVERTISE_HOST"] = own_address()
        port = env["PDSERVE_PORT"]
    else:
        env.setdefault("PDSERVE_GATEWAY_HOST", "0.0.0.0")
        port = env.setdefault("PDSERVE_GATEWAY_PORT", "8000")
    HEALTH_FILE.write_text(f"http://127.0.0.1:{port}/health\n")
    return fd


def health() -> int:
    """Exit 0 when the local service answers /health with 200 (compose healthcheck)."""
    url = HEALTH_FILE.read_text().strip() if HEALTH_FILE.exists() else "http://127.0.0.1:8000/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            status = json.loads(resp.read()).get("status")
    except (OSError, ValueError) as exc:  # urlopen raises HTTPError (an OSError) on 503
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if status == "ok" else 1


def main(argv: list[str]) -> None:
    if argv[:1] == ["--health"]:
        sys.exit(health())
    if not argv or argv[0] not in MODULES:
        raise SystemExit(f"usage: entrypoint.py {{{'|'.join(MODULES)}}} [flags...] | --health")
    module, args = argv[0], argv[1:]
    env = dict(os.environ)
    fd = prepare(module, env)
    if fd is not None:
        os.set_inheritable(fd, True)  # the worker process keeps the GPU locked for its lifetime
    os.execvpe(sys.executable, [sys.executable, "-m", module, *args], env)


if __name__ == "__main__":
    main(sys.argv[1:])
