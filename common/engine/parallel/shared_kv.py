"""Rank 0 of a tensor-parallel worker maps every other rank's KV cache into its own process, so its
one KV-transfer endpoint lands (and ships) each rank's heads straight in that rank's memory: no
rank gathers another's heads, and two workers need one connection whatever their TP sizes.

    CPU   a follower's cache lives in a memfd (anonymous shared memory, nothing on a filesystem);
          rank 0 opens it through /proc/<pid>/fd/<n> (allowed for the process that started it)
          and maps it.
    CUDA  a follower exports its cache as a CUDA IPC handle; rank 0 opens it (same host: the
          ranks of a worker always are).

The ranks tell rank 0 where their caches are with one all-gather of a small fixed-size record each
(JSON, never pickle), right after the caches exist; every rank calls ``share_caches`` there.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import mmap
import os
from dataclasses import dataclass

import torch

from common.engine.kv.kv_cache import KVCache, KVLayout, dtype_from_name
from common.engine.kv.kv_shards import KVShards
from common.engine.parallel.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

_RECORD_BYTES = 1024  # one rank's record, padded (a CUDA IPC handle is ~100 bytes)


@dataclass(frozen=True)
class _HostCache:
    pid: int
    fd: int
    nbytes: int


@dataclass(frozen=True)
class _CudaCache:
    device: int
    handle: bytes
    storage_nbytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    buffer_offset: int  # elements into the storage where the cache buffer starts


_KINDS = {"host": _HostCache, "cuda": _CudaCache}


def _encode(record: _HostCache | _CudaCache | None) -> bytes:
    """JSON (bytes as hex): the engine runs where msgspec is not installed (the GPU check)."""
    if record is None:
        return b"null"
    fields = {k: v.hex() if isinstance(v, bytes) else v for k, v in dataclasses.asdict(record).items()}
    kind = next(name for name, cls in _KINDS.items() if isinstance(record, cls))
    return json.dumps({"kind": kind, **fields}).encode()


def _decode(data: bytes) -> _HostCache | _CudaCache:
    fields = json.loads(data)
    if not isinstance(fields, dict) or fields.get("kind") not in _KINDS:
        raise RuntimeError("a follower rank reported no KV cache")
    cls = _KINDS[fields.pop("kind")]
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    return cls(**{k: bytes.fromhex(v) if types[k] == "bytes" else v for k, v in fields.items()})


def shared_host_zeros(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> tuple[torch.Tensor, int]:
    """A zeroed CPU tensor in a memfd that rank 0 can map (``share_caches``), and the memfd (kept
    open for the process's life: rank 0 opens it through it)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)  # zero-filled
    return torch.frombuffer(_map(fd, nbytes), dtype=torch.uint8).view(dtype).view(shape), fd


def _map(fd: int, nbytes: int) -> mmap.mmap:
    region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # a hint: shared memory gets huge pages only where enabled
    except (AttributeError, OSError):
        pass
    return region


def _record(cache: KVCache, host_fd: int | None) -> _HostCache | _CudaCache:
    buffer = cache.buffer
    if buffer.device.type == "cuda":
        storage = buffer.untyped_storage()
        (device, handle, storage_nbytes, storage_offset, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        return _CudaCache(device, handle, storage_nbytes, storage_offset, ref_handle, ref_offset,
                          event_handle or b"", bool(event_sync), buffer.storage_offset())
    if host_fd is None:
        raise RuntimeError("a follower rank's KV cache must be allocated with shared_host_zeros")
    return _HostCache(os.getpid(), host_fd, buffer.numel() * buffer.element_size())


def _open(record: _HostCache | _CudaCache, layout: KVLayout, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = dtype_from_name(layout.dtype)
    if isinstance(record, _HostCache):
        fd = os.open(f"/proc/{record.pid}/fd/{record.fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            region = _map(fd, record.nbytes)
        finally:
            os.close(fd)  # the mapping keeps the memory
        return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    if isinstance(record, _CudaCache):
        storage = torch.UntypedStorage._new_shared_cuda(
            record.device, record.handle, record.storage_nbytes, record.storage_offset, record.ref_counter_handle,
            record.ref_counter_offset, record.event_handle or None, record.event_sync_required)
        out = torch.empty(0, dtype=dtype, device=f"cuda:{record.device}")
        return out.set_(storage, record.buffer_offset, shape)
    raise RuntimeError(f"unknown KV cache record {record!r}")


def share_caches(tp: TensorParallel, cache: KVCache, head_ranges: list[tuple[int, int]], num_kv_heads: int,
                 host_fd: int | None = None) -> KVShards | None:
    """Every rank calls this once its cache exists (a follower on CPU: in ``shared_host_zeros``,
    whose fd is ``host_fd``).  Rank 0 gets every rank's cache (its own first) as ``KVShards``;
    the other ranks get None."""
    if tp.size == 1:
        return KVShards.single(cache)
    import torch.distributed as dist

    mine = _encode(_record(cache, host_fd) if tp.rank else None)
    if len(mine) > _RECORD_BYTES:
        raise RuntimeError(f"KV cache record of {len(mine)} bytes exceeds {_RECORD_BYTES}")
    padded = torch.zeros(_RECORD_BYTES + 8, dtype=torch.uint8)
    padded[:8] = torch.tensor(list(len(mine).to_bytes(8, "little")), dtype=torch.uint8)
    padded[8:8 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(gathered, padded, group=tp.control_group)
    if tp.rank:
        return None
    caches = [cache]
    shape = tuple(cache.buffer.shape)
    for rank in range(1, tp.size):
        raw = gathered[rank].numpy().tobytes()
        length = int.from_bytes(raw[:8], "little")
        record = _decode(raw[8:8 + length])
        buffer = _open(record, cache.layout, shape)
        caches.append(KVCache(cache.layout, cache.num_blocks, buffer=buffer,
                              scratch_block=cache.scratch_block is not None))
    log.info("tensor parallelism: rank 0 maps the KV caches of ranks 1..%d (%s)", tp.size - 1, cache.buffer.device.type)
    return KVShards(caches, head_ranges, num_kv_heads)
