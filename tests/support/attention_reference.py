"""Plain-torch stand-ins for flash-attn's two entry points (``flash_attn_varlen_func``,
``flash_attn_with_kvcache``): tests put them in place of the CUDA kernels."""
import math

import torch


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
