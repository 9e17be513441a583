"""Stand-ins for the gateway dispatcher's registry view: registry entries and a pool that routes
to them (unit tests of ``gateway.dispatch`` above the registry)."""
from __future__ import annotations

from common.cluster.registry import Capacity, KVAddress, Load, WorkerInfo

BS = 16
MODEL = "org/model"


def worker(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, state="active", model=MODEL,
                      http_address=f"http://{worker_id}:8000", kv_address=KVAddress("tcp", worker_id, 9000),
                      capacity=Capacity(num_kv_blocks=1000, block_size=BS, max_num_seqs=64), load=Load())


class Pool:
    """``WorkerPool``'s routing view over fixed workers."""

    def __init__(self, workers):
        self.workers = workers
        self.listeners = []

    def routable(self, exclude=()):
        return [w for w in self.workers if w.worker_id not in exclude]
