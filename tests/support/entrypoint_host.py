"""A recorded host for ``compose/entrypoint.py``'s unit tests: the entrypoint loaded as a module,
``nvidia-smi topo -m`` samples, a fake host probe, a worker's environment and lock release."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from launcher.local_stack import ROOT

COMPOSE = ROOT / "compose"

# A two-socket 8-GPU host: 4 cores x 2 threads per socket (CPUs 0-3 + siblings 8-11 on node 0,
# 4-7 + 12-15 on node 1), one compute HCA per GPU behind the GPU's PCIe switch, and mlx5_8, a
# management/storage NIC on socket 0.  The layout of a recent driver's `nvidia-smi topo -m`.
TOPO_8GPU = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tNIC4\tNIC5\tNIC6\tNIC7\tNIC8\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t0-3,8-11\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t0-3,8-11\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t0-3,8-11\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\t0-3,8-11\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tPIX\tNODE\tNODE\tNODE\tSYS\t4-7,12-15\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tNODE\tPIX\tNODE\tNODE\tSYS\t4-7,12-15\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tNODE\tSYS\t4-7,12-15\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tPIX\tSYS\t4-7,12-15\t1\t\tN/A
NIC0\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE
NIC8\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
  NIC3: mlx5_3
  NIC4: mlx5_4
  NIC5: mlx5_5
  NIC6: mlx5_6
  NIC7: mlx5_7
  NIC8: mlx5_8
"""

# An older driver: NICs named in the header, no legend, no GPU NUMA ID column; two GPUs and two
# HCAs behind one PCIe switch (equally close), no NUMA affinity reported.
TOPO_OLD_SWITCH = """\
        GPU0    GPU1    mlx5_0  mlx5_1  CPU Affinity
GPU0     X      PIX     PXB     PXB     0-7
GPU1    PIX      X      PXB     PXB     0-7
mlx5_0  PXB     PXB      X      PIX
mlx5_1  PXB     PXB     PIX      X
"""

SIBLINGS = {c: frozenset({c % 8, c % 8 + 8}) for c in range(16)}
INTERFACES = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eno1": "192.168.1.5", "ens1f0": "10.0.0.12"}
STRONG = {"PDSERVE_CLUSTER_SECRET": "k" * 32, "PDSERVE_ADMIN_TOKEN": "a" * 32}  # the gateway's secrets


@pytest.fixture(scope="module")
def ep():
    spec = importlib.util.spec_from_file_location("compose_entrypoint_t", COMPOSE / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def runtime_file(ep, tmp_path, monkeypatch):
    path = tmp_path / "runtime.json"
    monkeypatch.setattr(ep, "RUNTIME_FILE", path)
    return path


class FakeHost:
    """A recorded host: its GPUs, topology, interfaces and CPUs."""

    def __init__(self, gpus=("0", "1", "2", "3", "4", "5", "6", "7"), topology=TOPO_8GPU, interfaces=None,
                 cpus=range(16), tools=("numactl",)):
        self.gpus, self.topology, self.cpus, self.tools = list(gpus), topology, set(cpus), set(tools)
        self.ifaces = dict(INTERFACES if interfaces is None else interfaces)

    def gpu_indexes(self):
        return list(self.gpus)

    def topology_text(self):
        return self.topology

    def interfaces(self):
        return dict(self.ifaces)

    def allowed_cpus(self):
        return set(self.cpus)

    def cpu_siblings(self):
        return SIBLINGS

    def has(self, tool):
        return tool in self.tools


def worker_env(tmp_path, **extra) -> dict[str, str]:
    env = {"PDSERVE_CLUSTER_SECRET": STRONG["PDSERVE_CLUSTER_SECRET"], "PDSERVE_DEVICE": "cuda",  # no admin token
           "PDSERVE_LOCK_DIR": str(tmp_path / "locks"),
           "PDSERVE_ADVERTISE_HOST": "10.0.0.12", "REDIS_URL": "redis://:" + "r" * 24 + "@10.0.0.11:6379/0"}
    env.update(extra)
    return env


def release(launch):
    for fd in launch.lock_fds:
        os.close(fd)
