"""Plain-torch stand-ins for flash-attn's two entry points (``flash_attn_varlen_func``,
``flash_attn_with_kvcache``): tests put them in place of the CUDA kernels; ``paged_reference``,
fp32 attention over a paged cache as a backend should compute it; and ``scenario``, a step's
requests over a random paged cache."""
import math

import torch

from common.engine.attention.interface import AttentionRequest
from common.engine.kv.kv_cache import KVCache, KVLayout

HEADS, KV_HEADS, DIM = 4, 2, 8  # ``scenario``'s default layout


def scenario(block_size, num_blocks=64, seed=0, specs=None, dim=DIM, heads=HEADS, kv_heads=KV_HEADS):
    """By default three requests: a prompt chunk after a cached prefix, a decode, a fresh prompt."""
    g = torch.Generator().manual_seed(seed)
    layout = KVLayout("m", "float32", block_size, 1, kv_heads, dim)
    cache = KVCache(layout, num_blocks)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # (new tokens, context after step)
    specs = specs or [(5, 3 * block_size + 7), (1, 2 * block_size + 1), (9, 9)]
    requests, start = [], 0
    for n, ctx in specs:
        nblocks = math.ceil(ctx / block_size)
        requests.append(AttentionRequest(start, n, ctx, [perm.pop() for _ in range(nblocks)]))
        start += n
    q = torch.randn(start, heads, dim, generator=g)
    k = torch.randn(start, kv_heads, dim, generator=g)
    v = torch.randn(start, kv_heads, dim, generator=g)
    return cache, requests, q, k, v


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, block_table=None):
    """flash_attn_varlen_func's contract in plain torch (bottom-right causal alignment)."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if block_table is not None:  # paged: k is [num_blocks, block_size, heads, dim]
            bs = k.shape[1]
            n = ke - ks
            blocks = block_table[i, : math.ceil(n / bs)].long()
            keys, values = k[blocks].reshape(-1, *k.shape[2:])[:n], v[blocks].reshape(-1, *v.shape[2:])[:n]
        else:
            keys, values = k[ks:ke], v[ks:ke]
        lq, lk = qe - qs, keys.shape[0]
        qpos = torch.arange(lk - lq, lk)[:, None]
        kpos = torch.arange(lk)[None, :]
        mask = kpos <= qpos if causal else torch.ones(lq, lk, dtype=torch.bool)
        if window_size[0] >= 0:
            mask &= kpos >= qpos - window_size[0]
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], keys) * softmax_scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def kvcache_reference(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size):
    """flash_attn_with_kvcache's contract (paged, no new k/v) in plain torch: q is [B, Lq, H, D]."""
    batch, lq = q.shape[:2]
    cu_q = [i * lq for i in range(batch + 1)]
    cu_k = [0] + torch.cumsum(cache_seqlens.long(), 0).tolist()
    out = varlen_reference(q.reshape(-1, *q.shape[2:]), k_cache, v_cache, cu_q, cu_k, lq, max(cu_k),
                           softmax_scale, causal, window_size, block_table=block_table)
    return out.reshape(q.shape)


def paged_reference(cache, requests, q, k, v, window):
    """fp32 attention of ``q`` over layer 0 of ``cache`` (a ``KVCache``) after the new ``k`` / ``v``
    went to their slots -- rounded to the cache's dtype, as the cache holds them -- each request
    over its full context (``requests``: ``AttentionRequest``), scale ``head_dim ** -0.5``."""
    bs, dim, kv_heads = cache.block_size, q.shape[-1], k.shape[1]
    key, value = cache.key(0).float().clone(), cache.value(0).float().clone()
    rounded = lambda t: t.to(cache.buffer.dtype).float()  # noqa: E731
    for r in requests:
        for j in range(r.num_query_tokens):
            pos = r.context_len - r.num_query_tokens + j
            key[r.block_ids[pos // bs], pos % bs] = rounded(k[r.query_start + j])
            value[r.block_ids[pos // bs], pos % bs] = rounded(v[r.query_start + j])
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in requests:
        blocks = torch.tensor(r.block_ids)
        keys = key[blocks].reshape(-1, kv_heads, dim)[: r.context_len]
        values = value[blocks].reshape(-1, kv_heads, dim)[: r.context_len]
        rows = slice(r.query_start, r.query_start + r.num_query_tokens)
        window_size = (-1, -1) if window is None else (window - 1, 0)
        out[rows] = varlen_reference(q[rows].float(), keys, values, [0, r.num_query_tokens], [0, r.context_len], 0, 0,
                                     dim**-0.5, True, window_size)
    return out
