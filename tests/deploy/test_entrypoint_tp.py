"""compose/gpu_claims.py through the entrypoint: a tensor-parallel worker claims its N GPUs at
once, all or none, an aligned group first, next to one-GPU workers (the recorded
host of ``tests/support/entrypoint_host.py``: a two-socket 8-GPU topology)."""
from __future__ import annotations

import pytest

from tests.support.entrypoint_host import FakeHost, ep, release, runtime_file, worker_env  # noqa: F401 (fixtures)


def test_tensor_parallel_workers_claim_aligned_gpu_groups_next_to_one_gpu_workers(ep, tmp_path):
    """An 8-GPU host: one TP=4 prefill worker, two TP=2 decode workers; what is left is surplus."""
    host = FakeHost()
    tp4 = worker_env(tmp_path, PDSERVE_TENSOR_PARALLEL_SIZE="4")
    single = worker_env(tmp_path)
    launches = [ep.prepare("decode_svc", single, host)]  # GPU 0 first: the TP=4 group moves to 4-7
    launches.append(ep.prepare("prefill_svc", tp4, host))
    assert single["PDSERVE_GPU"] == "0"
    assert tp4["PDSERVE_GPU"] == "4,5,6,7" and tp4["CUDA_VISIBLE_DEVICES"].startswith("4,5,6,7,")
    assert tp4["PDSERVE_WORKER_ID"].endswith("-gpu4_5_6_7") and tp4["PDSERVE_PORT"] == "8104"
    assert len(launches[1].lock_fds) == 4
    assert sorted(launches[1].cpus) == [4, 5, 6, 7, 12, 13, 14, 15], "the CPUs of the group's NUMA node"
    assert tp4["OMP_NUM_THREADS"] == "1", "threads per rank: each rank is a process on its GPU's share"
    tp2 = worker_env(tmp_path, PDSERVE_TENSOR_PARALLEL_SIZE="2")
    launches.append(ep.prepare("decode_svc", tp2, host))
    assert tp2["PDSERVE_GPU"] == "2,3", "an aligned pair, not 1-2"
    with pytest.raises(ep.Surplus, match="1 of this host's gpus .* free .* needs 2"):  # GPU 1 is all that is left
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_TENSOR_PARALLEL_SIZE="2"), host)
    for launch in launches:
        release(launch)


def test_a_group_claim_takes_all_or_nothing(ep, tmp_path):
    host = FakeHost(gpus="0123", topology=None)
    first = ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_TENSOR_PARALLEL_SIZE="3"), host)
    with pytest.raises(ep.Surplus, match="1 of this host's gpus .* free .* needs 2"):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_TENSOR_PARALLEL_SIZE="2"), host)
    last = worker_env(tmp_path)
    second = ep.prepare("decode_svc", last, host)  # the failed group claim left GPU 3 free
    assert last["PDSERVE_GPU"] == "3"
    with pytest.raises(ep.Refusal, match="PDSERVE_TENSOR_PARALLEL_SIZE=8 but PDSERVE_GPUS gives .* 4 GPU"):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_TENSOR_PARALLEL_SIZE="8"), host)
    release(first)
    release(second)
