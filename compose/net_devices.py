"""A worker's network on its host: the address it advertises, the NICs and HCAs its UCX may use,
and what UCX reports it will use.  Used by ``entrypoint.py``; only the standard library.

``UCX_NET_DEVICES=auto`` becomes ``<HCA nearest the GPU>:<port>,<the NIC carrying the advertised
address>`` (``host_topology`` finds the HCA); an explicit list is checked: never ``all``, never a
bridge or veth, and a TCP interface whenever ``UCX_TLS`` allows TCP (the fallback between hosts).
"""
from __future__ import annotations

import re
import shutil
import socket
import subprocess

import host_topology as topo_mod

RDMA_TLS = re.compile(r"^\^?(rc|rc_v|rc_x|rc_mlx5|rc_verbs|dc|dc_x|dc_mlx5|ud|ud_v|ud_x|ud_mlx5|ud_verbs|ib)$")
UCX_PORTS_PER_WORKER = 16


class Refusal(Exception):
    """The configuration cannot work; the message says what to change (every check of the
    entrypoint raises it)."""


def run_tool(cmd: list[str], env: dict | None = None, timeout: float = 20) -> str | None:
    """stdout of ``cmd``, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def own_address() -> str:
    """This container's address on its network (the source address of a route outwards)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the interface
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def interface_for(address: str, interfaces: dict[str, str]) -> str | None:
    """The interface that holds ``address`` (a name is resolved first)."""
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return None
    return next((name for name, addr in interfaces.items() if addr == ip), None)


def wants_tls(env: dict[str, str], pattern: re.Pattern | str) -> bool:
    tls = [t.strip() for t in (env.get("UCX_TLS") or "all").split(",") if t.strip()]
    if not tls or tls == ["all"] or tls[0].startswith("^"):
        return True  # UCX's default (or an exclusion list) leaves every transport in
    return any(re.match(pattern, t) if isinstance(pattern, re.Pattern) else t == pattern for t in tls)


def check_net_devices(value: str, env: dict[str, str]) -> None:
    devices = [d.strip() for d in value.split(",") if d.strip()]
    if not devices or "all" in devices:
        raise Refusal("UCX_NET_DEVICES=all offers every interface (docker0, management NICs) to other hosts: set "
                      "it to `auto` (the HCA nearest the GPU and the NIC carrying the advertised address) or "
                      "list them, e.g. mlx5_0:1,ens1f0")
    virtual = [d for d in devices if topo_mod.is_virtual_netdev(d.split(":")[0])]
    if virtual:
        raise Refusal(f"UCX_NET_DEVICES lists {','.join(virtual)}, which other hosts cannot reach; name the "
                      f"cluster network's NIC instead")
    if wants_tls(env, "tcp") and not any(":" not in d for d in devices):
        raise Refusal(f"UCX_NET_DEVICES={value} has no TCP interface but UCX_TLS allows tcp: between hosts TCP is "
                      f"the fallback when RDMA is unavailable, so add the cluster NIC (e.g. {devices[0]},ens1f0), "
                      f"or drop tcp from UCX_TLS on purpose")


def hca_for(gpu: str | None, env: dict[str, str], topology: topo_mod.Topology | None) -> tuple[str | None, str]:
    """(``mlx5_N:port`` or None, how it was chosen)."""
    if gpu is None:
        return None, "no GPU"
    if env.get("PDSERVE_HCA_MAP"):
        hca = topo_mod.parse_hca_map(env["PDSERVE_HCA_MAP"]).get(gpu)
        if hca is None:
            raise Refusal(f"PDSERVE_HCA_MAP has no entry for GPU {gpu}; list every GPU of PDSERVE_GPUS")
        return hca, "PDSERVE_HCA_MAP"
    listed = (env.get("PDSERVE_HCAS") or "").strip()
    if listed == "none":
        return None, "PDSERVE_HCAS=none"
    if topology is None:
        return None, "no topology (nvidia-smi topo -m)"
    candidates = [h.strip() for h in listed.split(",") if h.strip()] or None
    hca = topo_mod.nearest_hca(topology, gpu, candidates)
    if hca is None:
        return None, "no HCA close to this GPU"
    port = env.get("PDSERVE_HCA_PORT") or "1"
    return (hca if ":" in hca else f"{hca}:{port}"), "nearest in nvidia-smi topo -m"


def configure_ucx(env: dict[str, str], slot: int, gpu: str | None, topology, probe) -> list[str]:
    """Set UCX_TCP_PORT_RANGE for ``slot`` and UCX_NET_DEVICES (``auto``: from ``topology`` and
    ``probe.interfaces()``); returns notes for the log.  Raises Refusal."""
    notes = []
    if not env.get("UCX_TCP_PORT_RANGE"):
        base = int(env.get("PDSERVE_UCX_TCP_PORT_BASE") or 8300) + slot * UCX_PORTS_PER_WORKER
        env["UCX_TCP_PORT_RANGE"] = f"{base}-{base + UCX_PORTS_PER_WORKER - 1}"
    value = (env.get("UCX_NET_DEVICES") or "auto").strip()
    if value != "auto":
        check_net_devices(value, env)
        notes.append(f"UCX_NET_DEVICES={value} (given)")
        return notes
    devices = []
    if wants_tls(env, RDMA_TLS):
        hca, why = hca_for(gpu, env, topology)
        if hca:
            devices.append(hca)
            notes.append(f"RDMA: {hca} for GPU {gpu} ({why})")
        else:
            notes.append(f"RDMA: none for this worker ({why}); KV to other hosts goes over TCP")
    if wants_tls(env, "tcp"):
        nic = env.get("PDSERVE_TCP_NIC") or interface_for(env["PDSERVE_ADVERTISE_HOST"], probe.interfaces())
        if not nic:
            raise Refusal(f"cannot tell which interface carries the advertised address "
                          f"{env['PDSERVE_ADVERTISE_HOST']}; set PDSERVE_TCP_NIC to the cluster network's NIC")
        if topo_mod.is_virtual_netdev(nic) and env.get("PDSERVE_NETWORK_MODE") == "host":
            raise Refusal(f"the advertised address is on {nic}, a bridge other hosts cannot reach: set HOST_ADDR "
                          f"to this host's address on the cluster network")
        devices.append(nic)
    if not devices:
        raise Refusal("UCX_NET_DEVICES=auto found no device (no HCA and TCP excluded from UCX_TLS)")
    env["UCX_NET_DEVICES"] = ",".join(devices)
    notes.append(f"UCX_NET_DEVICES={env['UCX_NET_DEVICES']} UCX_TCP_PORT_RANGE={env['UCX_TCP_PORT_RANGE']}")
    return notes


def ucx_lanes(text: str) -> list[str]:
    """``transport/device`` of each lane in ``ucx_info -e`` output (``tcp/eth0``, ``rc_mlx5/mlx5_0:1``)."""
    return [m.group(1) for m in re.finditer(r"lane\[\d+\]:\s+\d+:(\S+?)\.\d+\s", text)]


def report_ucx(env: dict[str, str]) -> str:
    """One line saying which UCX library and which transports this worker's KV will use."""
    if not shutil.which("ucx_info", path=env.get("PATH")):
        return "UCX: ucx_info not on PATH; cannot show the transports"
    version = run_tool(["ucx_info", "-v"], env) or ""
    library = re.search(r"Library path: (\S+)", version)
    parts = [f"UCX {library.group(1) if library else '(version unknown)'}"]
    for placement in ("inter", "intra"):
        lanes = ucx_lanes(run_tool(["ucx_info", "-e", "-u", "t", "-P", placement], env) or "")
        parts.append(f"{placement}-host lanes: {', '.join(dict.fromkeys(lanes)) or 'none (see ucx_info -d)'}")
    return "; ".join(parts)
