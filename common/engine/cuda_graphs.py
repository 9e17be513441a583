"""CUDA graphs for decode-only steps: one graph per batch-size bucket, replayed over persistent inputs.

A decode step launches hundreds of small kernels (every layer's matmuls, norms, rotary, KV write,
attention); at small batches the GPU waits on the CPU launching them. A graph captured once per
batch size replays them all with one launch. What a graph reads must live at fixed addresses,
so each bucket owns persistent buffers that every step overwrites in place::

    bucket of 8, 5 real requests
    input_ids  [ t0 t1 t2 t3 t4 | 0  0  0  ]
    positions  [ p0 p1 p2 p3 p4 | 0  0  0  ]
    metadata   the backend's own, built by its ``prepare`` for the padded batch and copied in:
               real rows: their slots, block tables, key counts;
               padding rows: one key at offset 0 of the scratch block (``KVCache.scratch_block``)

Padding rows write their K/V into the scratch block, which the block pool never hands out, and
attend to that one key, so they never touch a real block and always produce finite values; their
outputs are dropped. Only the backends whose decode launches depend on tensor contents alone
(``supports_cuda_graphs``: Triton, flash-attn's ``flash_attn_with_kvcache``) are captured. Steps
with a prompt chunk, or more requests than the largest bucket, run eagerly.

Capture happens once at start-up, largest bucket first, all graphs sharing one memory pool
(replays never overlap). ``capture`` is the only CUDA-specific call; tests put in one that re-runs
the step eagerly, so the buffer and padding logic runs on CPU.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable

import torch

from common.engine.attention.interface import AttentionRequest
from common.engine.kv.kv_cache import KVCache

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8, up to ``max_batch``
    (always included), as in vLLM. Padding costs at most 7 rows of a step that is bandwidth-bound."""
    sizes = {n for n in (1, 2, 4) if n < max_batch} | set(range(8, max_batch, 8)) | {max_batch}
    return sorted(sizes)


def bucket_for(num_requests: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``num_requests``; ``None`` when none does."""
    index = bisect.bisect_left(buckets, num_requests)
    return buckets[index] if index < len(buckets) else None


def padded_requests(requests: list[AttentionRequest], size: int, scratch_block: int) -> list[AttentionRequest]:
    """``requests`` (one new token each) followed by padding rows up to ``size``: each pads with one
    token at position 0 of the scratch block, so it writes and reads only there."""
    assert all(r.num_query_tokens == 1 for r in requests), "only decode-only steps are padded"
    return requests + [AttentionRequest(i, 1, 1, [scratch_block]) for i in range(len(requests), size)]


def copy_into(persistent, step) -> None:
    """Copy the tensors of ``step``'s metadata into the leading corner of ``persistent``'s (same
    class, every tensor at least as large in every dimension), recursing into nested dataclasses.
    Host values (ints) are not copied: a captured launch cannot depend on them."""
    if isinstance(step, torch.Tensor):
        assert step.dim() == persistent.dim() and all(a <= b for a, b in zip(step.shape, persistent.shape)), \
            f"step tensor {tuple(step.shape)} does not fit the captured {tuple(persistent.shape)}"
        persistent[tuple(slice(0, n) for n in step.shape)].copy_(step, non_blocking=True)
    elif dataclasses.is_dataclass(step):
        assert type(step) is type(persistent), f"{type(step).__name__} != {type(persistent).__name__}"
        for f in dataclasses.fields(step):
            value = getattr(step, f.name)
            if value is not None and not isinstance(value, (int, float, bool, str)):
                copy_into(getattr(persistent, f.name), value)


def capture(step: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``step`` into a CUDA graph; returns (replay, the graph's output tensor)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph.replay, output


def supported(device: torch.device, attention) -> bool:
    """Are decode steps captured on this device with this backend? (Never on CPU.)"""
    return torch.device(device).type == "cuda" and getattr(attention, "supports_cuda_graphs", False)


@dataclasses.dataclass
class _Graph:
    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    metadata: object  # the backend's metadata for ``size`` rows, persistent
    replay: Callable[[], None]
    output: torch.Tensor  # [size, hidden]


class CudaGraphs:
    """Decode-only steps of up to ``max_batch`` requests through captured graphs (see the module
    docstring). ``run`` returns the hidden states of the real rows, or ``None`` for a step it
    does not take (the caller runs it eagerly)."""

    def __init__(self, model, cache: KVCache, attention, max_batch: int, max_blocks_per_request: int,
                 device: torch.device, capture_fn=None):
        assert cache.scratch_block is not None, "CUDA graphs pad into the cache's scratch block"
        self.model = model
        self.cache = cache
        self.attention = attention
        self.device = torch.device(device)
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks_per_request
        self.graphs: dict[int, _Graph] = {}
        self._capture = capture_fn or capture

    def capture_all(self) -> "CudaGraphs":
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for size in reversed(self.buckets):  # largest first: the smaller ones fit in its pool
            self.graphs[size] = self._capture_bucket(size, pool)
        log.info("CUDA graphs captured for decode batches %s", self.buckets)
        return self

    def _capture_bucket(self, size: int, pool) -> _Graph:
        scratch = self.cache.scratch_block
        # Every row of the capture batch is a padding row with the widest block table; replays
        # copy real rows over them.
        widest = [AttentionRequest(i, 1, 1, [scratch] * self.max_blocks) for i in range(size)]
        metadata = self.attention.prepare(widest, self.device)
        input_ids = torch.zeros(size, dtype=torch.long, device=self.device)
        positions = torch.zeros(size, dtype=torch.long, device=self.device)

        def step() -> torch.Tensor:
            return self.model(input_ids, positions, self.cache, metadata, self.attention)

        step()  # warm-up outside the graph: kernels compile, libraries allocate their workspaces
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        replay, output = self._capture(step, pool)
        return _Graph(input_ids, positions, metadata, replay, output)

    def run(self, input_ids: list[int], positions: list[int], requests: list[AttentionRequest]) -> torch.Tensor | None:
        if not requests or any(r.num_query_tokens != 1 for r in requests):
            return None
        size = bucket_for(len(requests), self.buckets)
        if size is None or max(len(r.block_ids) for r in requests) > self.max_blocks:
            return None
        graph = self.graphs[size]
        padding = size - len(requests)
        copy_into(graph.metadata, self.attention.prepare(padded_requests(requests, size, self.cache.scratch_block),
                                                         "cpu"))
        graph.input_ids.copy_(torch.tensor(input_ids + [0] * padding), non_blocking=True)
        graph.positions.copy_(torch.tensor(positions + [0] * padding), non_blocking=True)
        graph.replay()
        return graph.output[: len(requests)]
