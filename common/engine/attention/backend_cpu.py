"""CPU paged attention that reads the KV cache in place: a small C kernel (csrc/paged_attention_cpu.c).

The kernel is compiled once per machine (``common.engine.cpu_kernels``); the call releases
the GIL. One call per layer covers every request of the step, prompt chunks and decodes alike; nothing is gathered
and no mask is built::

    step metadata (built once per step, shared by all layers)
        block_table   int32 [R, max_blocks]   block ids of each request, zero-padded
        query_start   int32 [R + 1]           where each request's new tokens start in the batch
        context_lens  int32 [R]               keys after this step (cached + new)
        slot_blocks / slot_offsets  [T]       where each new token's K/V is written

    per layer:  cache[slot_blocks, slot_offsets] = k, v     then     kernel(q, cache, table, ...)

Where the kernel has no vector path for the layer's shape (a GQA group other than 1, 2, 4 or 8, or
a head width that is not a multiple of 16), a step's trailing run of fresh prompts (requests with
no KV before this step: first chunks of prompts -- the scheduler puts decodes and continued chunks
first, new prompts last) is left out of the kernel's call: their keys and values are this step's
own, contiguous in ``k`` and ``v``, and torch's fused CPU attention (``scaled_dot_product_attention``,
causal, the window as a mask) computes them several times faster than the scalar per-query loop.
The vector path is faster than torch's fused attention (Gemma 3 270M's layout on an AVX-512 Zen 5:
1.7-1.9x for prompts of 64-512 tokens; its AVX2 build 1.0-1.3x), so there the kernel takes them too.

``build_kernel`` returns ``None`` (and says why in the log) where there is no compiler;
``make_attention`` then falls back to the pure-torch path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.attention.interface import step_layout
from common.engine.kv.block_table import BlockTable
from common.engine.cpu_kernels import kernel_function, load_kernel, profiled
from common.engine.kv.kv_cache import KVCache

log = logging.getLogger(__name__)

# the dtypes the kernel reads: its elem (queries: fp32, bf16) and cache_elem (those, and fp8 e4m3)
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float8_e4m3fn: 1}


@functools.cache
def _row_writer():
    """``csrc/kv_write_cpu.c``'s entry, or None (no compiler)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("kv_write_cpu", "kv_write", [ptr, ptr, ctypes.c_int] + [i64] * 5 + [ptr, ptr, ptr, i64, ptr]
                           + [i64] * 4, ctypes.c_int)


def _rows(t: torch.Tensor) -> bool:
    """Whether ``t`` [tokens, kv_heads, head_dim] is fp32 rows the kernel reads (each token's heads contiguous)."""
    return t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def kernel_slots(slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, tokens: int,
                 who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' KV slots as the C kernels read them (int64, contiguous); ``ValueError`` naming
    ``who`` where their number is not ``tokens``'."""
    blocks, offsets = slot_blocks.to(torch.int64).contiguous(), slot_offsets.to(torch.int64).contiguous()
    if len(blocks) != tokens or len(offsets) != tokens:
        raise ValueError(f"{who}: {tokens} tokens for {len(blocks)} / {len(offsets)} KV slots")
    return blocks, offsets


def write_rows(keys: torch.Tensor, values: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> bool:
    """``keys[slot_blocks, slot_offsets] = k`` and the same for the values (one layer's caches
    ``[blocks, block_size, kv_heads, head_dim]``, rounded to their dtype), by the C kernel; False where
    it does not apply (the caller assigns them)."""
    cache_elem = ELEMENT_BYTES.get(keys.dtype)
    on_cpu = all(t.device.type == "cpu" for t in (keys, values, slot_blocks, slot_offsets, k, v))
    if (cache_elem is None or not on_cpu or not (_rows(k) and _rows(v)) or k.shape != v.shape
            or values.dtype != keys.dtype or values.shape != keys.shape or keys.shape[2:] != k.shape[1:]
            or keys.stride() != values.stride() or keys.stride(3) != 1 or torch.compiler.is_compiling()
            or _row_writer() is None):
        return False
    blocks, offsets = kernel_slots(slot_blocks, slot_offsets, k.shape[0], "KV write")
    if _row_writer()(keys.data_ptr(), values.data_ptr(), cache_elem, keys.shape[0], keys.shape[1], keys.stride(0),
                     keys.stride(1), keys.stride(2), blocks.data_ptr(), offsets.data_ptr(), k.data_ptr(), k.stride(0),
                     v.data_ptr(), v.stride(0), k.shape[0], k.shape[1], k.shape[2]) != 0:
        raise IndexError("KV write: a slot outside the cache")
    return True


def build_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, then reused from the cache); ``None`` if it cannot be built."""
    lib = load_kernel("paged_attention_cpu")
    return declared(lib) if lib is not None else None


def declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of csrc/paged_attention_cpu.c) with its entries' signatures declared."""
    fn = lib.paged_attention
    fn.restype = ctypes.c_int
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [i32, i32, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr,
                   i32, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
    lib.paged_attention_vector_path.argtypes = [i32, i32, i32, i32]
    lib.paged_attention_vector_path.restype = i32
    return lib


@dataclass
class CpuMetadata:
    """One step's metadata for ``CpuPagedAttention`` (see the module docstring)."""

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    block_table: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    max_context: int
    kernel_requests: int  # without a vector path, the first this many requests go to the kernel
    dense: list[tuple[int, int]]  # (first token, tokens) of each fresh prompt after them


def step_metadata(requests, block_size: int, block_table: BlockTable | None = None) -> CpuMetadata:
    """From the requests' block ids, or from ``block_table`` (see ``attention.step_layout``)."""
    step = step_layout(requests, block_size, block_table)
    kernel_requests = len(requests)
    while kernel_requests and _fresh_prompt(requests[kernel_requests - 1]):
        kernel_requests -= 1
    dense = [(r.query_start, r.num_query_tokens) for r in requests[kernel_requests:]]
    return CpuMetadata(step.slot_blocks, step.slot_offsets, step.block_table, step.query_start, step.context_lens,
                       step.max_context, kernel_requests, dense)


def _fresh_prompt(request) -> bool:
    """All of its keys are this step's: nothing was cached before."""
    return request.context_len == request.num_query_tokens


@functools.lru_cache(maxsize=8)
def _window_mask(length: int, window: int) -> torch.Tensor:
    """Which keys each query sees, causal and within ``window`` (built once per prompt length and
    window, not once per layer)."""
    position = torch.arange(length)
    return (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - window)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                           scale: float) -> torch.Tensor:
    """One fresh prompt's attention over its own keys: q [L, H, D], k/v [L, KVH, D] -> [L, H, D].
    A query at position i sees keys at i - window < j <= i (as the paged kernel does)."""
    length = q.shape[0]
    mask = _window_mask(length, window) if window and length > window else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


class CpuPagedAttention:
    """The CPU backend: writes the step's K/V into its slots, then one kernel call per layer."""

    name = "cpu"

    def __init__(self, windows: set[int | None], block_size: int, kernel: ctypes.CDLL, num_threads: int | None = None):
        self.block_size = block_size
        self.kernel = kernel
        self.num_threads = num_threads
        # The KV manager's persistent table (``Engine`` hands it over); ``None``: tables per step.
        self.block_table: BlockTable | None = None
        self._vector_paths: dict[tuple[int, int, int], bool] = {}  # (elem, group, width): the kernel's answer

    def prepare(self, requests, device) -> CpuMetadata:
        return step_metadata(requests, self.block_size, self.block_table)

    def write_kv(self, k, v, cache: KVCache, layer: int, meta: CpuMetadata) -> None:
        """k, v: [T, KVH, D] for the new tokens, into their slots (``forward`` does this first): fp32
        rows by ``csrc/kv_write_cpu.c``, others by the cache's indexed assignment (the same bits)."""
        if not write_rows(cache.key(layer), cache.value(layer), meta.slot_blocks, meta.slot_offsets, k, v):
            cache.write(layer, meta.slot_blocks, meta.slot_offsets, k, v)

    def forward(self, q, k, v, cache: KVCache, layer: int, meta: CpuMetadata, window, scale) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens.  Returns [T, H, D]."""
        key_cache, value_cache = cache.key(layer), cache.value(layer)
        self.write_kv(k, v, cache, layer, meta)
        elem, cache_elem = ELEMENT_BYTES.get(q.dtype), ELEMENT_BYTES.get(key_cache.dtype)
        assert elem and elem > 1 and cache_elem, f"cpu attention: {q.dtype} queries over a {key_cache.dtype} cache"
        if q.stride(-1) != 1:
            q = q.contiguous()
        assert key_cache.stride(-1) == 1 and key_cache.stride() == value_cache.stride(), "unexpected cache layout"
        tokens, heads, dim = q.shape
        out = torch.empty((tokens, heads, dim), dtype=q.dtype)
        table = meta.block_table
        vector = self.vector_path(elem, cache_elem, heads // key_cache.shape[2], dim)
        every_request = len(meta.query_start) - 1
        kernel_requests, dense = (every_request, []) if vector else (meta.kernel_requests, meta.dense)
        if kernel_requests:
            with profiled("cpu_paged_attention"):
                rc = self._call(elem, cache_elem, q, key_cache, value_cache, out, table, meta, kernel_requests,
                                window, scale, heads, dim)
            if rc != 0:
                raise MemoryError("cpu paged attention: scratch allocation failed")
        for start, length in dense:
            end = start + length
            out[start:end] = dense_causal_attention(q[start:end], *_as_cached(k[start:end], v[start:end], key_cache),
                                                    window, scale)
        return out

    def vector_path(self, elem: int, cache_elem: int, group: int, dim: int) -> bool:
        """Whether the kernel has a vector path for (bytes a query value, bytes a cached value, GQA
        group, head width): then every request of a step goes to it."""
        key = (elem, cache_elem, group, dim)
        if key not in self._vector_paths:
            self._vector_paths[key] = bool(self.kernel.paged_attention_vector_path(elem, cache_elem, group, dim))
        return self._vector_paths[key]

    def _call(self, elem, cache_elem, q, key_cache, value_cache, out, table, meta, requests, window, scale, heads,
              dim) -> int:
        threads = self.num_threads or torch.get_num_threads()
        return self.kernel.paged_attention(
            elem, cache_elem, q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), out.data_ptr(), table.data_ptr(),
            table.stride(0), meta.query_start.data_ptr(), meta.context_lens.data_ptr(), requests,
            heads, key_cache.shape[2], dim, self.block_size, window or 0, float(scale), meta.max_context, threads,
        )


def _as_cached(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh prompt's own keys and values as the cache holds them (rounded to its dtype), in
    the queries' dtype: the dense path sees what the kernel would have read."""
    if cache.dtype == k.dtype:
        return k, v
    return k.to(cache.dtype).to(k.dtype), v.to(cache.dtype).to(v.dtype)


def supports(dtype: torch.dtype) -> bool:
    return dtype in ELEMENT_BYTES
