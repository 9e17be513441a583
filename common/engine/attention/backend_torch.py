"""The pure-torch attention backend: the reference every other backend is checked against, and the
CPU fallback where the C kernel does not build."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.engine.attention.interface import AttentionMetadata, AttentionRequest
from common.engine.kv.kv_cache import KVCache


def slot_tensors(requests: list[AttentionRequest], block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, offsets = [], []
    for req in requests:
        first = req.context_len - req.num_query_tokens
        for pos in range(first, req.context_len):
            blocks.append(req.block_ids[pos // block_size])
            offsets.append(pos % block_size)
    return (
        torch.tensor(blocks, dtype=torch.long, device=device),
        torch.tensor(offsets, dtype=torch.long, device=device),
    )


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, context_len: torch.Tensor, window: int | None):
    """Boolean mask: may a query at ``query_pos`` see the key at ``key_pos``?"""
    ok = (key_pos <= query_pos) & (key_pos < context_len)
    if window is not None:
        ok &= key_pos > query_pos - window
    return ok


def _length_buckets(decodes: list[AttentionRequest], ratio: float = 2.0, slack: int = 256) -> list[list[AttentionRequest]]:
    """Group decoding requests by context length so one long context does not make every short
    one gather and attend over its padding: within a group the longest context is at most
    ``ratio`` times (or ``slack`` tokens more than) the shortest."""
    groups: list[list[AttentionRequest]] = []
    for r in sorted(decodes, key=lambda r: r.context_len):
        if groups:
            shortest = groups[-1][0].context_len
            if r.context_len <= max(shortest * ratio, shortest + slack):
                groups[-1].append(r)
                continue
        groups.append([r])
    return groups


class TorchAttention:
    """Pure-torch paged attention: gathers each request's blocks and runs SDPA with a mask.

    Decoding requests (one query token) are batched into one SDPA call; prompt chunks run one
    call each, so no request is padded to another's prompt length.
    """

    name = "torch"

    def __init__(self, windows: set[int | None], block_size: int):
        self.windows = windows
        self.block_size = block_size

    def prepare(self, requests: list[AttentionRequest], device) -> AttentionMetadata:
        bs = self.block_size
        slot_blocks, slot_offsets = slot_tensors(requests, bs, device)
        decodes = [r for r in requests if r.num_query_tokens == 1]
        prefills = [r for r in requests if r.num_query_tokens > 1]
        extra = {"decodes": [], "prefills": []}
        for group in _length_buckets(decodes):
            max_blocks = max(len(r.block_ids) for r in group)
            table = torch.zeros((len(group), max_blocks), dtype=torch.long)
            for i, r in enumerate(group):
                table[i, : len(r.block_ids)] = torch.tensor(r.block_ids)
            context = torch.tensor([r.context_len for r in group])[:, None]
            key_pos = torch.arange(max_blocks * bs)[None, :]
            masks = {w: _visible(context - 1, key_pos, context, w)[:, None, None, :].to(device) for w in self.windows}
            extra["decodes"].append((
                torch.tensor([r.query_start for r in group], device=device),
                table.to(device),
                masks,
            ))
        for r in prefills:
            num_blocks = -(-r.context_len // bs)
            query_pos = torch.arange(r.context_len - r.num_query_tokens, r.context_len)[:, None]
            key_pos = torch.arange(num_blocks * bs)[None, :]
            context = torch.tensor(r.context_len)
            masks = {w: _visible(query_pos, key_pos, context, w)[None, None].to(device) for w in self.windows}
            block_ids = torch.tensor(r.block_ids[:num_blocks], dtype=torch.long, device=device)
            extra["prefills"].append((r.query_start, r.num_query_tokens, block_ids, masks))
        return AttentionMetadata(slot_blocks, slot_offsets, extra)

    def write_kv(self, k, v, cache: KVCache, layer: int, meta: AttentionMetadata) -> None:
        """k, v: [T, KVH, D] for the new tokens, into their slots (``forward`` does this first)."""
        cache.write(layer, meta.slot_blocks, meta.slot_offsets, k, v)

    def forward(self, q, k, v, cache: KVCache, layer: int, meta: AttentionMetadata, window, scale) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens.  Returns [T, H, D]."""
        key_cache, value_cache = cache.key(layer), cache.value(layer)
        self.write_kv(k, v, cache, layer, meta)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for index, table, masks in meta.extra["decodes"]:
            batch = table.shape[0]
            keys = key_cache[table].reshape(batch, -1, *key_cache.shape[2:]).transpose(1, 2).to(q.dtype)
            values = value_cache[table].reshape(batch, -1, *value_cache.shape[2:]).transpose(1, 2).to(q.dtype)
            query = q[index][:, :, None, :]  # [B, H, 1, D]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=masks[window], scale=scale, enable_gqa=gqa)
            out[index] = attn[:, :, 0, :]
        for start, length, block_ids, masks in meta.extra["prefills"]:
            keys = key_cache[block_ids].reshape(1, -1, *key_cache.shape[2:]).transpose(1, 2).to(q.dtype)
            values = value_cache[block_ids].reshape(1, -1, *value_cache.shape[2:]).transpose(1, 2).to(q.dtype)
            query = q[start : start + length].transpose(0, 1)[None]  # [1, H, L, D]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=masks[window], scale=scale, enable_gqa=gqa)
            out[start : start + length] = attn[0].transpose(0, 1)
        return out
