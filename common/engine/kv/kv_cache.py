"""Paged KV-cache tensors, block-major so one block's KV for every layer is one contiguous region.

Storage layout (one tensor for the whole cache)::

    buffer[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
            |            |          |
            |            |          +-- 0 = K, 1 = V
            |            +-- layer
            +-- block id (the id the block pool hands out)

    key(layer)   -> buffer[:, layer, 0]   shape [num_blocks, block_size, num_kv_heads, head_dim]
    value(layer) -> buffer[:, layer, 1]   (the flash-attn paged layout; the block stride
                                           skips the other layers)

A transfer of block ``b`` is the raw bytes of ``buffer[b]``: ``block_nbytes`` contiguous bytes,
so a run of consecutive block ids is a single contiguous region as well.
"""
from __future__ import annotations

import os

import torch

from common.engine.kv.host_memory import huge_page_zeros

from common.engine.structs import Struct

# Bumped whenever the meaning of the bytes in a block changes; checked in the KV-transfer handshake.
KV_LAYOUT_VERSION = 1


class KVLayout(Struct, frozen=True):
    """Everything a peer must agree on before KV bytes can move between two caches."""

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_version: int = KV_LAYOUT_VERSION

    @property
    def block_nbytes(self) -> int:
        itemsize = torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatches(self, other: "KVLayout") -> list[str]:
        """Names of the fields that differ, with both values, e.g. ``["dtype: float32 != bfloat16"]``."""
        out = []
        for field in self.__struct_fields__:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field}: {mine!r} != {theirs!r}")
        return out


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,  # a KV cache's only (--kv-cache-dtype fp8): e4m3, no scale, as vLLM's fp8
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


class KVCache:
    """The paged KV cache of one worker: a single block-major tensor plus per-layer K/V views.

    With ``scratch_block`` the buffer holds one block more than ``num_blocks``: block id
    ``num_blocks``, which the block pool never hands out, for the padding rows of CUDA-graph
    batches to write into (``common.engine.cuda_graphs``).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 scratch_block: bool = False, buffer: torch.Tensor | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.scratch_block: int | None = num_blocks if scratch_block else None
        shape = self.buffer_shape(layout, num_blocks, scratch_block)
        dtype = dtype_from_name(layout.dtype)
        if buffer is not None:  # memory allocated elsewhere (shared with another process)
            if tuple(buffer.shape) != shape or buffer.dtype != dtype or not buffer.is_contiguous():
                raise ValueError(f"a KV buffer of {tuple(buffer.shape)} {buffer.dtype}, expected {shape} {dtype}")
            self.buffer = buffer
        elif torch.device(device).type == "cpu":
            self.buffer = huge_page_zeros(shape, dtype)  # KV shipping through CMA pins pages: fewer, faster
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self._keys = [self.buffer[:, layer, 0] for layer in range(layout.num_layers)]
        self._values = [self.buffer[:, layer, 1] for layer in range(layout.num_layers)]

    @staticmethod
    def buffer_shape(layout: KVLayout, num_blocks: int, scratch_block: bool = False) -> tuple[int, ...]:
        return (num_blocks + int(scratch_block), layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                layout.head_dim)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def block_nbytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def key(self, layer: int) -> torch.Tensor:
        return self._keys[layer]

    def value(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def write(self, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """The new tokens' keys and values (``[tokens, kv_heads, head_dim]``, any float dtype) into
        their slots of ``layer``, rounded to the cache's dtype where it differs (round to nearest even)."""
        dtype = self.buffer.dtype
        self._keys[layer][slot_blocks, slot_offsets] = k.to(dtype)
        self._values[layer][slot_blocks, slot_offsets] = v.to(dtype)

    def block(self, block_id: int) -> torch.Tensor:
        """The contiguous ``[num_layers, 2, block_size, kv_heads, head_dim]`` region of one block."""
        return self.buffer[block_id]

    def blocks(self, first_block_id: int, count: int) -> torch.Tensor:
        """A contiguous run of ``count`` blocks starting at ``first_block_id`` (no copy)."""
        return self.buffer[first_block_id : first_block_id + count]


def contiguous_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Split block ids into ``(first_id, count)`` runs of consecutive ids, preserving order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def num_blocks_for_memory(layout: KVLayout, fraction: float, device: torch.device | str = "cpu") -> int:
    """How many blocks fit in ``fraction`` of the memory available now on ``device``."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv memory fraction must be in (0, 1], got {fraction}")
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = _host_memory_available()
    return max(1, int(free * fraction) // layout.block_nbytes)


MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"  # in a container, its own cgroup (cgroup namespaces)


def _host_memory_available(meminfo: str = MEMINFO, cgroup_root: str = CGROUP_ROOT) -> int:
    """Bytes this process can still allocate: MemAvailable, capped by what its cgroup's memory limit
    leaves (inside a pod /proc/meminfo describes the node, not the pod's limit)."""
    with open(meminfo) as lines:
        for line in lines:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
        else:
            raise RuntimeError(f"cannot read MemAvailable from {meminfo}")
    headroom = cgroup_memory_headroom(cgroup_root)
    return available if headroom is None else min(available, headroom)


def cgroup_memory_headroom(root: str = CGROUP_ROOT) -> int | None:
    """The cgroup's memory limit less its working set, in bytes; None where no limit is set or readable.

    cgroup v2: ``memory.max`` ("max" = no limit) less ``memory.current``; cgroup v1:
    ``memory/memory.limit_in_bytes`` less ``memory/memory.usage_in_bytes``.  Usage counts the page
    cache, which the kernel reclaims under the limit: its inactive file pages (``memory.stat``'s
    ``inactive_file``, v1's ``total_inactive_file``) are not taken as used -- the working set, as the
    kubelet counts it (a pod that read its weights would otherwise get a fraction of its cache)."""
    for limit_name, usage_name, stat_name, reclaimable in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        try:
            with open(os.path.join(root, limit_name)) as f:
                limit = f.read().strip()
            with open(os.path.join(root, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max":
            return None
        try:
            return max(0, int(limit) - max(0, usage - _stat(os.path.join(root, stat_name), reclaimable)))
        except ValueError:
            continue
    return None


def _stat(path: str, name: str) -> int:
    """The value of ``name`` in a cgroup's ``memory.stat`` (0 where it is missing)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
