"""What a worker container learns about its GPU host: which GPUs exist, and for each GPU the RDMA
NIC nearest to it, its CPUs and its NUMA node.  Used by ``entrypoint.py``; only the standard library.

Sources (both printed by the driver's ``nvidia-smi``, which the NVIDIA container toolkit mounts in):

    nvidia-smi --query-gpu=index --format=csv,noheader      ->  GPU indexes this container can use
    nvidia-smi topo -m                                      ->  the matrix below

    <tab>GPU0  GPU1  NIC0  NIC1  NIC2  CPU Affinity    NUMA Affinity  GPU NUMA ID
    GPU0  X    NV18  PIX   SYS   SYS   0-55,112-167    0              N/A
    GPU1  NV18  X    SYS   PIX   SYS   56-111,168-223  1              N/A
    ...
    NIC Legend:
      NIC0: mlx5_0
      NIC1: mlx5_1
      NIC2: mlx5_bond_0

Older drivers name the NICs in the header directly (``mlx5_0``) and print no legend.  GPU indexes
are nvidia-smi's, i.e. PCI bus order; the entrypoint sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that
CUDA numbers the GPUs the same way.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# Closer is better: the link from a GPU to a NIC, as `nvidia-smi topo -m` names it.
LINK_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
# Bridges and virtual interfaces that are never a path to another host.
VIRTUAL_NETDEV = re.compile(r"^(docker\d*|br-[0-9a-f]+|veth.*|virbr\d*|cni\d*|flannel.*|cali.*|lo)$")


class TopologyError(ValueError):
    """The topology text could not be read (the message says what was expected)."""


@dataclass
class Topology:
    """The GPU rows of ``nvidia-smi topo -m``: links to NICs, CPU and NUMA affinity, by GPU index."""

    nics: list[str] = field(default_factory=list)             # NIC device names, in column order
    links: dict[str, dict[str, str]] = field(default_factory=dict)  # gpu -> nic -> PIX|PXB|PHB|NODE|SYS
    cpus: dict[str, list[int]] = field(default_factory=dict)  # gpu -> its NUMA node's CPUs ([] if unknown)
    numa: dict[str, str | None] = field(default_factory=dict)  # gpu -> NUMA node, or None

    @property
    def gpus(self) -> list[str]:
        return list(self.links)


def parse_gpu_indexes(text: str) -> list[str]:
    """``nvidia-smi --query-gpu=index --format=csv,noheader`` -> ``["0", "1", ...]``."""
    indexes = [line.strip() for line in text.splitlines() if line.strip()]
    bad = [i for i in indexes if not i.isdigit()]
    if bad:
        raise TopologyError(f"unexpected GPU index lines from nvidia-smi: {bad[:3]}")
    return indexes


def parse_topology(text: str) -> Topology:
    """Read the matrix printed by ``nvidia-smi topo -m``."""
    lines = [line.rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_at is None:
        raise TopologyError("no header line starting with GPU0 (is this `nvidia-smi topo -m` output?)")
    tokens = lines[header_at].split()
    columns = tokens[:tokens.index("CPU")] if "CPU" in tokens else tokens
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M))
    names = [legend.get(c, c) for c in columns]
    topo = Topology(nics=[n for c, n in zip(columns, names) if not c.startswith("GPU")])
    for line in lines[header_at + 1:]:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        if len(cells) < 1 + len(columns):
            raise TopologyError(f"row {cells[0]} has {len(cells) - 1} cells, expected {len(columns)} or more")
        gpu = cells[0][3:]
        row = dict(zip(names, cells[1:1 + len(columns)]))
        topo.links[gpu] = {nic: row[nic] for nic in topo.nics}
        rest = cells[1 + len(columns):]
        topo.cpus[gpu] = parse_cpu_list(rest[0]) if rest and rest[0] != "N/A" else []
        topo.numa[gpu] = rest[1] if len(rest) > 1 and rest[1].isdigit() else None
    if not topo.links:
        raise TopologyError("no GPU rows in the topology")
    return topo


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise TopologyError(f"bad CPU list {text!r}")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(cpus))


def format_cpu_list(cpus) -> str:
    """The inverse of ``parse_cpu_list``: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, run = [], []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def nearest_hca(topo: Topology, gpu: str, candidates: list[str] | None = None,
                max_link: str = "NODE") -> str | None:
    """The NIC closest to ``gpu`` among ``candidates`` (default: every NIC in the matrix).

    GPUs that see the same set of equally close NICs share them out in GPU order, so two GPUs
    behind one PCIe switch with two NICs get one NIC each.  A NIC farther than ``max_link`` (by
    default: across the inter-socket link) is not worth using for RDMA: None then.
    """
    if gpu not in topo.links:
        return None
    pool = [n for n in topo.nics if candidates is None or n in candidates]

    def best(g: str) -> tuple[int, tuple[str, ...]]:
        ranks = {n: LINK_RANK.get(topo.links[g].get(n, "SYS"), 9) for n in pool}
        top = min(ranks.values(), default=9)
        return top, tuple(n for n in pool if ranks[n] == top)

    rank, nearest = best(gpu)
    if not nearest or rank > LINK_RANK[max_link]:
        return None
    peers = sorted((g for g in topo.gpus if best(g) == (rank, nearest)), key=int)
    return nearest[peers.index(gpu) % len(nearest)]


def parse_hca_map(text: str) -> dict[str, str]:
    """Operator-given ``"0=mlx5_0:1,1=mlx5_1:1"`` -> ``{"0": "mlx5_0:1", "1": "mlx5_1:1"}``."""
    mapping = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        gpu, sep, hca = item.partition("=")
        if not sep or not gpu.strip().isdigit() or not hca.strip():
            raise TopologyError(f"PDSERVE_HCA_MAP entry {item!r} is not GPU=HCA[:port] (e.g. 0=mlx5_0:1)")
        mapping[gpu.strip()] = hca.strip()
    return mapping


def physical_cores(cpus: list[int], siblings: dict[int, frozenset[int]]) -> list[tuple[int, ...]]:
    """Group logical CPUs into physical cores (hyperthread siblings together), in CPU order."""
    seen: set[int] = set()
    cores = []
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        core = tuple(sorted((siblings.get(cpu) or frozenset({cpu})) & set(cpus) | {cpu}))
        seen.update(core)
        cores.append(core)
    return cores


def cpu_share(topo: Topology, gpu: str, gpus: list[str], allowed: set[int],
              siblings: dict[int, frozenset[int]]) -> tuple[list[int], int]:
    """The CPUs a worker on ``gpu`` is pinned to, and its number of physical cores.

    The GPUs of ``gpus`` that share ``gpu``'s CPU affinity (one NUMA node, usually) split that
    node's physical cores in GPU order, whole cores each, so no two workers share a core or its
    hyperthread.  Only CPUs in ``allowed`` (the container's cpuset) are used.  ``([], 0)`` when
    the topology gives no affinity for the GPU.
    """
    mine = [c for c in topo.cpus.get(gpu, []) if c in allowed]
    if not mine:
        return [], 0
    same = sorted((g for g in gpus if g in topo.cpus and topo.cpus[g] == topo.cpus[gpu]), key=int)
    if gpu not in same:
        same = sorted(same + [gpu], key=int)
    cores = physical_cores(mine, siblings)
    k, n = same.index(gpu), len(same)
    chunk = cores[len(cores) * k // n: len(cores) * (k + 1) // n] or [cores[k % len(cores)]]
    return sorted(c for core in chunk for c in core), len(chunk)


def is_virtual_netdev(name: str) -> bool:
    """Docker/CNI bridges, veth pairs and loopback: never a path to another host."""
    return bool(VIRTUAL_NETDEV.match(name))
