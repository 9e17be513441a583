"""flash-attn 2 over the paged cache in place: its kernels read the block table, nothing is gathered.

flash-attn 2 takes a block table only when the block size is a multiple of 256
(``FLASH_PAGED_BLOCK_MULTIPLE``, the documented constraint of both ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``); ``make_attention`` picks the Triton backend for any other block size,
and this backend refuses one.

Each layer writes the new K/V into their slots (one indexed store per cache), then:

    decode-only step (every request 1 new token)  flash_attn_with_kvcache(q [B, 1, H, D], caches,
                                                      cache_seqlens, block_table)
    any step with a prompt chunk                  flash_attn_varlen_func(q [T, H, D], caches,
                                                      cu_seqlens_q, cu_seqlens_k, block_table)

The decode call takes no host-side lengths, so it is what a CUDA graph captures; the varlen call
needs ``max_seqlen_q/k`` as host ints. Both align the causal mask bottom-right (the last query
sees every key), which is the packed batch's convention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.attention.interface import AttentionRequest, PagedMetadata, flash_pages, FLASH_PAGED_BLOCK_MULTIPLE
from common.engine.kv.kv_cache import KVCache


@dataclass
class FlashMetadata:
    paged: PagedMetadata
    slot_blocks: torch.Tensor  # int64 [num_tokens] block of each new token's slot
    slot_offsets: torch.Tensor  # int64 [num_tokens] offset inside it
    cu_seq_lens: torch.Tensor | None  # int32 [num_seqs + 1] cumulative keys (cu_seqlens_k); None: decode-only


class FlashAttention:
    """flash-attn 2's paged kernels (see the module docstring); ``supports_cuda_graphs``: its
    decode-only steps depend only on tensor contents."""

    name = "flash"
    supports_cuda_graphs = True

    def __init__(self, windows: set[int | None], block_size: int, varlen_func=None, kvcache_func=None):
        if not flash_pages(block_size):
            raise ValueError(f"flash-attn reads a paged cache only with a block size that is a multiple of "
                             f"{FLASH_PAGED_BLOCK_MULTIPLE}, got {block_size}; use the triton backend")
        if varlen_func is None or kvcache_func is None:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

            varlen_func = varlen_func or flash_attn_varlen_func
            kvcache_func = kvcache_func or flash_attn_with_kvcache
        self.varlen = varlen_func
        self.with_kvcache = kvcache_func
        self.block_size = block_size
        self.block_table = None  # the KV manager's persistent ``BlockTable`` (``Engine`` hands it over)

    def prepare(self, requests: list[AttentionRequest], device) -> FlashMetadata:
        paged = PagedMetadata.build(requests, self.block_size, device, self.block_table)
        decode_only = paged.max_query_len == 1
        cu_k = None if decode_only else F.pad(paged.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return FlashMetadata(paged, paged.slots // self.block_size, paged.slots % self.block_size, cu_k)

    def write_kv(self, k, v, cache: KVCache, layer: int, meta: FlashMetadata) -> None:
        """k, v: [T, KVH, D] for the new tokens, into their slots (``forward`` does this first)."""
        cache.write(layer, meta.slot_blocks, meta.slot_offsets, k, v)

    def forward(self, q, k, v, cache: KVCache, layer: int, meta: FlashMetadata, window, scale) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens.  Returns [T, H, D]."""
        key_cache, value_cache = cache.key(layer), cache.value(layer)
        self.write_kv(k, v, cache, layer, meta)
        paged = meta.paged
        window_size = (-1, -1) if window is None else (window - 1, 0)
        if meta.cu_seq_lens is None:
            out = self.with_kvcache(q.unsqueeze(1), key_cache, value_cache, cache_seqlens=paged.seq_lens,
                                    block_table=paged.block_table, softmax_scale=scale, causal=True,
                                    window_size=window_size)
            return out.squeeze(1)
        return self.varlen(
            q, key_cache, value_cache, paged.query_start, meta.cu_seq_lens, paged.max_query_len, paged.max_seq_len,
            softmax_scale=scale, causal=True, window_size=window_size, block_table=paged.block_table,
        )
