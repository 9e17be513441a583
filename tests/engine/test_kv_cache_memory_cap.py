"""The CPU KV cache is sized from the memory this process may still use: /proc/meminfo's
MemAvailable capped by its cgroup's limit less usage (in a pod, meminfo is the node's memory)."""
from __future__ import annotations

import functools

import pytest

from common.engine.kv import kv_cache
from common.engine.kv.kv_cache import KVLayout, _host_memory_available, cgroup_memory_headroom, num_blocks_for_memory

GIB = 1 << 30


@pytest.fixture
def meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {512 * GIB // 1024} kB\nMemAvailable:   {256 * GIB // 1024} kB\n")
    return str(path)


def cgroup_v2(root, limit: str, current: int):
    root.mkdir()
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    return str(root)


def cgroup_v1(root, limit: int, usage: int):
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    return str(root)


def test_a_cgroup_v2_limit_caps_the_node_memory(tmp_path, meminfo):
    root = cgroup_v2(tmp_path / "cg", str(8 * GIB), 3 * GIB)
    assert cgroup_memory_headroom(root) == 5 * GIB
    assert _host_memory_available(meminfo, root) == 5 * GIB


def test_the_page_cache_the_kernel_can_reclaim_is_not_counted_as_used(tmp_path, meminfo):
    """(A pod that read its weights has them in its page cache: counted as used, its KV cache got a
    fraction of its headroom.)"""
    root = cgroup_v2(tmp_path / "cg", str(8 * GIB), 7 * GIB)
    (tmp_path / "cg" / "memory.stat").write_text(f"anon {GIB}\nfile {6 * GIB}\ninactive_file {5 * GIB}\n")
    assert cgroup_memory_headroom(root) == 6 * GIB
    v1 = cgroup_v1(tmp_path / "v1", 8 * GIB, 7 * GIB)
    (tmp_path / "v1" / "memory" / "memory.stat").write_text(f"cache {6 * GIB}\ntotal_inactive_file {5 * GIB}\n")
    assert cgroup_memory_headroom(v1) == 6 * GIB


def test_cgroup_v2_max_means_no_limit(tmp_path, meminfo):
    root = cgroup_v2(tmp_path / "cg", "max", 3 * GIB)
    assert cgroup_memory_headroom(root) is None
    assert _host_memory_available(meminfo, root) == 256 * GIB


def test_a_cgroup_v1_limit_caps_the_node_memory(tmp_path, meminfo):
    root = cgroup_v1(tmp_path / "cg", 16 * GIB, 6 * GIB)
    assert _host_memory_available(meminfo, root) == 10 * GIB


def test_a_limit_above_the_node_memory_leaves_meminfo(tmp_path, meminfo):
    root = cgroup_v1(tmp_path / "cg", 1 << 62, GIB)  # v1's "unlimited" is a huge number
    assert _host_memory_available(meminfo, root) == 256 * GIB


def test_no_cgroup_files_leave_meminfo(tmp_path, meminfo):
    assert cgroup_memory_headroom(str(tmp_path)) is None
    assert _host_memory_available(meminfo, str(tmp_path)) == 256 * GIB


def test_a_full_cgroup_has_no_headroom(tmp_path, meminfo):
    root = cgroup_v2(tmp_path / "cg", str(4 * GIB), 5 * GIB)
    assert _host_memory_available(meminfo, root) == 0


def test_the_cpu_cache_is_sized_from_the_pod_limit(tmp_path, meminfo, monkeypatch):
    layout = KVLayout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    root = cgroup_v2(tmp_path / "cg", str(8 * GIB), 0)
    monkeypatch.setattr(kv_cache, "_host_memory_available", functools.partial(_host_memory_available, meminfo, root))
    assert num_blocks_for_memory(layout, 0.5) == (4 * GIB) // layout.block_nbytes
