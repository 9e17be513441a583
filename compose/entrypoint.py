"""Container entrypoint for workers and the gateway: check secrets, claim a GPU, pin CPUs and NICs, exec.

    python compose/entrypoint.py prefill_svc [worker flags...]     # or decode_svc, gateway
    python compose/entrypoint.py --health                          # the compose health check
    python compose/entrypoint.py --whoami                          # JSON: worker id, GPU, ports (pdctl)
    python compose/entrypoint.py --drain [SECONDS]                 # drain this worker, wait idle (preStop)

It refuses to start (exit 78, a message saying what to change) rather than run in a way that
looks healthy but is not:

- a secret that is empty, a placeholder (``change-me...``) or shorter than 16 characters
  (``PDSERVE_CLUSTER_SECRET``, the Redis password in ``REDIS_URL``, and for the gateway
  ``PDSERVE_ADMIN_TOKEN`` and ``PDSERVE_API_KEY``, the latter unless ``PDSERVE_ALLOW_NO_API_KEY=1``),
  or an admin token equal to the cluster secret; each may come from a file instead (``PDSERVE_CLUSTER_SECRET_FILE``,
  ``PDSERVE_ADMIN_TOKEN_FILE``, ``PDSERVE_REDIS_PASSWORD_FILE``; API keys: ``PDSERVE_API_KEYS_FILE``);
- a worker without an explicit ``PDSERVE_DEVICE`` (``cuda`` or ``cpu``): ``auto`` would quietly
  serve an fp32 model on the CPU where no GPU is visible;
- ``PDSERVE_DEVICE=cuda`` where this container sees no GPU, or where ``PDSERVE_GPUS`` names GPUs
  the host does not have;
- ``UCX_NET_DEVICES=all`` or a Docker bridge / veth in it, or a device list without a TCP
  interface while ``UCX_TLS`` allows TCP (TCP is the fallback between hosts);
- the gateway behind the TLS front (``docker-compose.tls.yml`` sets ``PDSERVE_TLS_FRONT=1``) while
  its plain-HTTP port is published beyond loopback (``PDSERVE_GATEWAY_BIND``): clients must reach
  it only through TLS.

GPU claim.  ``PDSERVE_GPUS`` (``all``, the default, or indexes like ``0,1,2,3``) lists the GPUs the
workers of this host may take; a replica takes the first whose lock file in ``PDSERVE_LOCK_DIR``
(a volume every worker container of the host mounts) it can ``flock``.  A tensor-parallel worker
(``PDSERVE_TENSOR_PARALLEL_SIZE=N``) takes N GPUs at once, all or none, under a host-wide claim
lock: an aligned group (GPUs 0-1, 2-3, ... for N=2; 0-3, 4-7 for N=4: the same switch and NUMA
node on the usual hosts) where one is free, else any N free ones; pools of different N share a
host, each GPU locked by the worker that holds it.  The lock is held by the
worker process itself (the descriptor survives ``exec``), so it is released exactly when the
worker exits.  A replica that finds every GPU taken is surplus: it says so and exits 0, and the
services' ``restart: on-failure`` leaves it down.  Slot ``i`` (the position of the claimed GPU in
the list) then gives::

    CUDA_VISIBLE_DEVICES = <claimed>,<the others>   cuda:0..N-1 are the claimed GPUs (rank r on
                           <claimed>                cuda:r); the peers' GPUs stay visible for CUDA
                                                    IPC (only the claimed ones with
                                                    PDSERVE_GPU_ISOLATION=1)
    PDSERVE_WORKER_ID    = <hostname>-gpu<claimed>  (unless set; gpu<a>_<b>_... for a group)
    PDSERVE_PORT         = PDSERVE_PORT_BASE + i    (unless set; host networking needs distinct ports)
    PDSERVE_KV_PORT      = PDSERVE_KV_PORT_BASE + i
    UCX_TCP_PORT_RANGE   = PDSERVE_UCX_TCP_PORT_BASE + 16 i .. + 16 i + 15   (UCX's TCP data ports)

CPU workers claim the same way from ``PDSERVE_CPUSETS`` (``0-3;4-7``: one CPU list per worker), if set.

Topology (GPU workers; from ``nvidia-smi topo -m``, or the file ``PDSERVE_TOPOLOGY_FILE``): the
worker is pinned to its share of the CPUs of its GPU's NUMA node (whole cores, ``OMP_NUM_THREADS``
= that many cores unless set), its memory prefers that node (``numactl``, when present), and
``UCX_NET_DEVICES=auto`` becomes ``<HCA nearest the GPU>:<port>,<the NIC carrying the advertised
address>``.  ``PDSERVE_HCA_MAP`` (``0=mlx5_0:1,1=mlx5_1:1``) overrides the choice;
``PDSERVE_HCAS`` limits it to the compute fabric's HCAs (``none``: no RDMA).  At start-up the
entrypoint prints what UCX will use (``ucx_info -e``: the lanes to another host).

Advertised address (``PDSERVE_ADVERTISE_HOST`` unset): this container's IP address on its network.
Bind address (``PDSERVE_HOST`` unset): ``0.0.0.0`` in a container's own network namespace (its
interfaces are the container's); on the host's network (``PDSERVE_NETWORK_MODE=host``) the
advertised address, so a worker never listens on every interface of the host.

Only the standard library, ``common.cluster.auth`` and ``common.cluster.secret_sources`` (standard
library only themselves); the network and UCX part lives in ``net_devices.py``, the slot locks in
``gpu_claims.py``.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import struct
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # host_topology; common.cluster.auth from the source tree

import host_topology as topo_mod  # noqa: E402
from gpu_claims import Surplus, claim, tensor_parallel_size, visible_devices  # noqa: E402
from net_devices import (  # noqa: E402,F401 (interface_for, ucx_lanes: re-exported for the tests)
    Refusal, configure_ucx, interface_for, own_address, report_ucx, run_tool, ucx_lanes,
)
from common.cluster.auth import SECRET_ENV, is_loopback, secret_problem  # noqa: E402
from common.cluster.direct_http import urlopen  # noqa: E402 (its own health: never through an http_proxy)
from common.cluster.secret_sources import secret_from_env  # noqa: E402
from kvtransfer.config import default_transport  # noqa: E402

RUNTIME_FILE = Path(os.environ.get("PDSERVE_RUNTIME_FILE", "/tmp/pdserve-runtime.json"))
MODULES = ("prefill_svc", "decode_svc", "gateway")
EXIT_CONFIG = 78  # sysexits EX_CONFIG: a restart will not help until the configuration changes
MAKE_SECRET = ("make one with `pdctl gen-secrets` (writes compose/.env, mode 0600) or "
               "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`")
# Variables compose sets to "" when the operator leaves them unset; their tools read "" as a value.
SHARED_CORES_OMP_THREADS = 2  # threads per CPU worker without a CPU set of its own (PDSERVE_CPUSETS unset)
DROP_IF_EMPTY = re.compile(r"^(UCX_|OMP_|CUDA_|NCCL_|HF_|HUGGING_FACE_|TRANSFORMERS_)")


def kv_transport(env) -> str:
    """The KV transport the worker will run: its flag's variable, or the flag's default."""
    return env.get("PDSERVE_KV_TRANSPORT") or default_transport()


@dataclass
class Launch:
    """What ``prepare`` decided: the command prefix, CPUs to pin, the lock to keep, what to print."""

    prefix: list[str] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    lock_fds: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class HostProbe:
    """The host as the container sees it; tests substitute recorded answers."""

    def gpu_indexes(self) -> list[str]:
        out = run_tool(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"])
        return topo_mod.parse_gpu_indexes(out) if out is not None else []

    def topology_text(self) -> str | None:
        return run_tool(["nvidia-smi", "topo", "-m"])

    def interfaces(self) -> dict[str, str]:
        """Interface name -> its IPv4 address (SIOCGIFADDR), for interfaces that have one."""
        found = {}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _index, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue  # no IPv4 address
                found[name] = socket.inet_ntoa(packed[20:24])
        return found

    def allowed_cpus(self) -> set[int]:
        return set(os.sched_getaffinity(0))

    def cpu_siblings(self) -> dict[int, frozenset[int]]:
        siblings = {}
        for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list"):
            cpu = int(path.parts[-3][3:])
            try:
                siblings[cpu] = frozenset(topo_mod.parse_cpu_list(path.read_text()))
            except (OSError, ValueError):
                continue
        return siblings

    def has(self, tool: str) -> bool:
        return shutil.which(tool) is not None


# ---- secrets ---------------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _secret(name: str, env: dict[str, str]) -> str | None:
    """``name``'s value, from the file ``{name}_FILE`` names when set (a Refusal if unreadable)."""
    try:
        return secret_from_env(name, env)
    except ValueError as exc:
        raise Refusal(str(exc)) from None


def check_secrets(module: str, env: dict[str, str]) -> list[str]:
    """Refuse placeholder, weak or shared secrets; returns notes for the log.  The admin token is
    the gateway's alone: workers take signed admin calls and no token."""
    required = {SECRET_ENV: _secret(SECRET_ENV, env)}
    redis_url = env.get("REDIS_URL")
    if redis_url:
        parsed = urllib.parse.urlsplit(redis_url)
        if parsed.hostname and parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
            password = _secret("PDSERVE_REDIS_PASSWORD", {"PDSERVE_REDIS_PASSWORD_FILE": env.get(
                "PDSERVE_REDIS_PASSWORD_FILE", "")}) or urllib.parse.unquote(parsed.password or "")
            required["the Redis password in REDIS_URL (REDIS_PASSWORD)"] = password
    notes = []
    if module == "gateway":
        required["PDSERVE_ADMIN_TOKEN"] = _secret("PDSERVE_ADMIN_TOKEN", env)
        if env.get("PDSERVE_API_KEYS_FILE"):
            pass  # the gateway checks every key of the file (strength, no key equal to another secret)
        elif _truthy(env.get("PDSERVE_ALLOW_NO_API_KEY")) and not env.get("PDSERVE_API_KEY"):
            notes.append("PDSERVE_ALLOW_NO_API_KEY=1: the API needs no key (only behind your own authenticating proxy)")
        else:
            required["PDSERVE_API_KEY"] = env.get("PDSERVE_API_KEY")
    elif env.get("PDSERVE_ADMIN_TOKEN") or env.get("PDSERVE_ADMIN_TOKEN_FILE"):
        notes.append("PDSERVE_ADMIN_TOKEN is set but a worker takes no admin token (the gateway signs its admin "
                     "calls): remove it from the worker's environment")
    for name, value in required.items():
        problem = secret_problem(value)
        if problem:
            hint = " (or set PDSERVE_ALLOW_NO_API_KEY=1 to serve without one)" if name == "PDSERVE_API_KEY" else ""
            raise Refusal(f"{name} is not usable: {problem}; {MAKE_SECRET}{hint}")
    if required[SECRET_ENV] == required.get("PDSERVE_ADMIN_TOKEN"):
        raise Refusal(f"PDSERVE_ADMIN_TOKEN and {SECRET_ENV} are the same value: each must be its own random secret "
                      f"(whoever holds the cluster secret must not be an operator); {MAKE_SECRET}")
    return notes


def check_tls_front(env: dict[str, str]) -> None:
    """Behind the TLS front the gateway's plain-HTTP port stays on loopback (the TLS front is an
    override file because a compose profile cannot change the gateway's published port)."""
    bind = env.get("PDSERVE_GATEWAY_BIND") or "127.0.0.1"
    if _truthy(env.get("PDSERVE_TLS_FRONT")) and not is_loopback(bind):
        raise Refusal(f"with the TLS front (docker-compose.tls.yml) the gateway's plain-HTTP port is published on "
                      f"{bind} (PDSERVE_GATEWAY_BIND), where clients would bypass TLS: keep PDSERVE_GATEWAY_BIND="
                      f"127.0.0.1 (the default), or leave docker-compose.tls.yml out to serve plain HTTP")


# ---- slots: one GPU (or CPU set) per worker ----------------------------------------------------


def resolve_gpus(env: dict[str, str], probe: HostProbe) -> list[str]:
    """The GPUs this host's workers may claim: real ones only, or a refusal that says why."""
    present = probe.gpu_indexes()
    if not present:
        raise Refusal("PDSERVE_DEVICE=cuda but this container sees no GPU (`nvidia-smi` lists none): give the "
                      "service the GPUs (deploy.resources.reservations.devices, NVIDIA container toolkit). "
                      "Refusing to start rather than serve from the CPU.")
    wanted = (env.get("PDSERVE_GPUS") or "all").strip()
    if wanted == "all":
        return present
    gpus = [g.strip() for g in wanted.split(",") if g.strip()]
    missing = [g for g in gpus if g not in present]
    if missing or not gpus:
        raise Refusal(f"PDSERVE_GPUS={wanted} names GPU(s) {','.join(missing) or '(none)'} that this host does not "
                      f"have (it has {','.join(present)}); set PDSERVE_GPUS=all or list real indexes")
    return gpus


# ---- CPUs --------------------------------------------------------------------------------------


def pin_cpus(env: dict[str, str], claimed: list[str], gpus: list[str], topology, probe: HostProbe,
             launch: Launch) -> None:
    """Pin the worker to the CPU shares of its GPUs (every rank's), threads per rank to its share."""
    if (env.get("PDSERVE_CPU_PINNING") or "auto") == "off":
        return
    allowed = probe.allowed_cpus()
    cpus, cores = [], 0
    for gpu in claimed:
        share, share_cores = ([], 0)
        if topology is not None:
            share, share_cores = topo_mod.cpu_share(topology, gpu, gpus, allowed, probe.cpu_siblings())
        if not share:
            # No topology: an equal share of the container's CPUs, so workers do not all spin on all of them.
            ordered = sorted(allowed)
            k, n = gpus.index(gpu), len(gpus)
            share = ordered[len(ordered) * k // n: len(ordered) * (k + 1) // n] or ordered
            share_cores = len(share)
        cpus += [c for c in share if c not in cpus]
        cores += share_cores
    launch.cpus = cpus
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // len(claimed))))  # each rank is its own process
    gpu = claimed[0]
    node = topology.numa.get(gpu) if topology is not None else None
    if node is not None and (env.get("PDSERVE_NUMA_BIND") or "auto") != "off" and probe.has("numactl"):
        launch.prefix = ["numactl", f"--preferred={node}"]
    launch.notes.append(f"CPUs {topo_mod.format_cpu_list(cpus)} ({cores} cores, OMP_NUM_THREADS="
                        f"{env['OMP_NUM_THREADS']}), NUMA node {node if node is not None else 'unknown'}")


# ---- shutdown ----------------------------------------------------------------------------------

STOP_MARGIN_S = 15.0  # after the drain: KV connections, Redis deregistration, process exit


def parse_duration(text: str) -> float:
    """Compose's durations (``150s``, ``2m30s``, ``1h``, ``90``) in seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise Refusal(f"PDSERVE_STOP_GRACE={text!r} is not a duration like 150s or 2m30s")
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def check_stop_grace(env: dict[str, str]) -> None:
    """The container's stop grace period (compose passes it as PDSERVE_STOP_GRACE) must cover the
    worker's drain, or Docker kills it mid-drain and cuts the streams the drain was finishing."""
    if not env.get("PDSERVE_STOP_GRACE"):
        return
    grace = parse_duration(env["PDSERVE_STOP_GRACE"])
    drain = float(env.get("PDSERVE_DRAIN_TIMEOUT") or 30)
    if grace < drain + STOP_MARGIN_S:
        raise Refusal(f"stop_grace_period {env['PDSERVE_STOP_GRACE']} does not cover PDSERVE_DRAIN_TIMEOUT={drain:g} "
                      f"plus {STOP_MARGIN_S:g} s to shut down: raise PDSERVE_WORKER_STOP_GRACE to at least "
                      f"{drain + STOP_MARGIN_S:g}s or lower the drain timeout")


# ---- the whole preparation --------------------------------------------------------------------


def read_topology(env: dict[str, str], probe: HostProbe) -> tuple[topo_mod.Topology | None, str | None]:
    path = env.get("PDSERVE_TOPOLOGY_FILE")
    text = Path(path).read_text() if path else probe.topology_text()
    if not text:
        return None, "no topology from `nvidia-smi topo -m`: no CPU/NUMA pinning or HCA choice"
    try:
        return topo_mod.parse_topology(text), None
    except topo_mod.TopologyError as exc:
        return None, f"unreadable topology ({exc}): no CPU/NUMA pinning or HCA choice"


def prepare_worker(env: dict[str, str], probe: HostProbe, launch: Launch) -> tuple[int, str | None]:
    """Claim a slot and set device, ports, CPUs and UCX; returns (slot, GPU index or None)."""
    check_stop_grace(env)
    device = (env.get("PDSERVE_DEVICE") or "").strip()
    lock_dir = Path(env.get("PDSERVE_LOCK_DIR") or "/run/pdserve-locks")
    if device not in ("cuda", "cuda:0", "cpu"):
        raise Refusal(f"PDSERVE_DEVICE={device or '(unset)'}: set it to cuda (GPU hosts) or cpu; the entrypoint "
                      f"picks the GPU (cuda:N is not accepted) and never guesses the device")
    slot, gpu, gpus, topology = 0, None, [], None
    if device.startswith("cuda"):
        gpus = resolve_gpus(env, probe)
        slots, launch.lock_fds = claim(gpus, lock_dir, "gpu", tensor_parallel_size(env, gpus))
        slot, claimed = slots[0], [gpus[s] for s in slots]
        gpu = claimed[0]  # rank 0's: it moves the worker's KV (the nearest HCA is its)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's numbering = nvidia-smi's
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, slots, _truthy(env.get("PDSERVE_GPU_ISOLATION")))
        env["PDSERVE_DEVICE"] = "cuda"
        env["PDSERVE_GPU"] = ",".join(claimed)
        # Readable and stable across restarts: <hostname>-gpu<n> (the host's name on the host
        # network, the container id otherwise).
        env.setdefault("PDSERVE_WORKER_ID", f"{socket.gethostname()}-gpu{'_'.join(claimed)}")
        topology, problem = read_topology(env, probe)
        if problem:
            launch.notes.append(problem)
        pin_cpus(env, claimed, gpus, topology, probe, launch)
        launch.notes.append(f"GPU {','.join(claimed)} (slot {slot} of {','.join(gpus)})")
    else:
        if env.get("PDSERVE_GPUS"):
            raise Refusal("PDSERVE_GPUS is set but PDSERVE_DEVICE=cpu: use the GPU compose file, or unset PDSERVE_GPUS")
        cpusets = [c.strip() for c in (env.get("PDSERVE_CPUSETS") or "").split(";") if c.strip()]
        if cpusets:
            slots, launch.lock_fds = claim(cpusets, lock_dir, "cpuset")
            slot = slots[0]
            launch.cpus = [c for c in topo_mod.parse_cpu_list(cpusets[slot]) if c in probe.allowed_cpus()]
            if not launch.cpus:
                raise Refusal(f"PDSERVE_CPUSETS entry {cpusets[slot]} has no CPU this container may use")
            env.setdefault("OMP_NUM_THREADS", str(len(launch.cpus)))
            launch.notes.append(f"CPUs {cpusets[slot]} (slot {slot})")
        else:  # the workers share the host's cores: they take turns on them (common/engine/core_turns.py)
            env.setdefault("PDSERVE_CORE_TURNS", str(lock_dir / "core-turns.lock"))
            env.setdefault("OMP_NUM_THREADS", str(SHARED_CORES_OMP_THREADS))
            launch.notes.append(f"CPUs shared, turns on {env['PDSERVE_CORE_TURNS']}")
    env.setdefault("PDSERVE_PORT", str(int(env.get("PDSERVE_PORT_BASE") or 8100) + slot))
    env.setdefault("PDSERVE_KV_PORT", str(int(env.get("PDSERVE_KV_PORT_BASE") or 8200) + slot))
    if not env.get("PDSERVE_ADVERTISE_HOST"):
        env["PDSERVE_ADVERTISE_HOST"] = own_address()
    if not env.get("PDSERVE_HOST"):
        # The host's network: the cluster address only.  A container's own namespace: all of it.
        env["PDSERVE_HOST"] = env["PDSERVE_ADVERTISE_HOST"] if env.get("PDSERVE_NETWORK_MODE") == "host" else "0.0.0.0"
    if kv_transport(env) == "ucx":
        launch.notes += configure_ucx(env, slot, gpu, topology, probe)
    return slot, gpu


def prepare(module: str, env: dict[str, str], probe: HostProbe | None = None) -> Launch:
    """Check and fill in ``env`` for ``module``.  Raises Refusal or Surplus."""
    probe = probe or HostProbe()
    for name in [k for k, v in env.items() if v == "" and DROP_IF_EMPTY.match(k)]:
        del env[name]
    launch = Launch()
    launch.notes += check_secrets(module, env)
    info: dict = {"module": module}
    if module == "gateway":
        check_tls_front(env)
        env.setdefault("PDSERVE_GATEWAY_HOST", "0.0.0.0")
        port = env.setdefault("PDSERVE_GATEWAY_PORT", "8000")
    else:
        slot, gpu = prepare_worker(env, probe, launch)
        port = env["PDSERVE_PORT"]
        info.update(worker_id=env.get("PDSERVE_WORKER_ID"), gpu=env.get("PDSERVE_GPU"), slot=slot, kv_port=int(env["PDSERVE_KV_PORT"]),
                    advertise_host=env["PDSERVE_ADVERTISE_HOST"])
    info.update(port=int(port), health_url=f"http://{_local_address(env, module)}:{port}/health")
    RUNTIME_FILE.write_text(json.dumps(info) + "\n")
    return launch


def _local_address(env: dict[str, str], module: str) -> str:
    """Where this container's health check reaches the service: its bind address, unless that is
    every interface (then loopback)."""
    host = env.get("PDSERVE_GATEWAY_HOST" if module == "gateway" else "PDSERVE_HOST") or "0.0.0.0"
    if host in ("0.0.0.0", "::", "[::]"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def health() -> int:
    """Exit 0 when the local service answers /health with status ok (compose healthcheck)."""
    try:
        url = json.loads(RUNTIME_FILE.read_text())["health_url"]
    except (OSError, ValueError, KeyError):
        url = "http://127.0.0.1:8000/health"
    try:
        with urlopen(url, timeout=5) as resp:
            status = json.loads(resp.read()).get("status")
    except (OSError, ValueError) as exc:  # urlopen raises HTTPError (an OSError) on 503
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if status == "ok" else 1


def whoami() -> int:
    """Print the runtime file (worker id, GPU, ports): how ``pdctl`` maps containers to workers."""
    try:
        print(RUNTIME_FILE.read_text().strip())
        return 0
    except OSError:
        print("{}")
        return 1


def main(argv: list[str]) -> None:
    if argv[:1] == ["--health"]:
        sys.exit(health())
    if argv[:1] == ["--whoami"]:
        sys.exit(whoami())
    if argv[:1] == ["--drain"]:
        import local_drain

        sys.exit(local_drain.main(argv[1:]))
    if not argv or argv[0] not in MODULES:
        raise SystemExit(f"usage: entrypoint.py {{{'|'.join(MODULES)}}} [flags...] | --health | --whoami | --drain")
    module, args = argv[0], argv[1:]
    env = dict(os.environ)
    try:
        launch = prepare(module, env)
    except Surplus as exc:
        print(f"entrypoint: {exc}", flush=True)
        sys.exit(0)
    except (Refusal, topo_mod.TopologyError) as exc:
        print(f"entrypoint: refusing to start {module}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    for note in launch.notes:
        print(f"entrypoint: {note}", flush=True)
    if module != "gateway" and kv_transport(env) == "ucx":
        print(f"entrypoint: {report_ucx(env)}", flush=True)
    if launch.cpus:
        os.sched_setaffinity(0, launch.cpus)  # inherited across exec
    for fd in launch.lock_fds:
        os.set_inheritable(fd, True)  # the worker process keeps its GPUs locked for its lifetime
    command = [*launch.prefix, sys.executable, "-m", module, *args]
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main(sys.argv[1:])
