"""Paged attention over the block-major KV cache: a pure-torch path (CPU) and flash-attn (CUDA).

Both backends see the same packed batch: the new tokens of every scheduled request laid end to
end, no padding between requests::

    tokens   [ r0 chunk (37 tokens) | r1 decode | r2 decode | r3 chunk (12) ]
    positions  p0 .. p0+36            q1          q2          p3 .. p3+11

Each layer first writes the new K/V into the cache slots of its tokens, then every query attends
to its request's cached keys up to its own position (and only the last ``window`` of them on
sliding-window layers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.engine.kv_cache import KVCache


@dataclass
class AttentionRequest:
    """One request's slice of the packed batch, as attention needs it."""

    query_start: int  # index of its first token in the packed batch
    num_query_tokens: int
    context_len: int  # tokens with KV after this step (cached + new)
    block_ids: list[int]


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer; built once by ``AttentionBackend.prepare``."""

    slot_blocks: torch.Tensor  # [num_tokens] block id each new token's KV goes to
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    extra: dict = field(default_factory=dict)


def _slot_tensors(requests: list[AttentionRequest], block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
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
        slot_blocks, slot_offsets = _slot_tensors(requests, bs, device)
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

    def forward(self, q, k, v, cache: KVCache, layer: int, meta: AttentionMetadata, window, scale) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens.  Returns [T, H, D]."""
        key_cache, value_cache = cache.key(layer), cache.value(layer)
        key_cache[meta.slot_blocks, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, meta.slot_offsets] = v
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for index, table, masks in meta.extra["decodes"]:
            batch = table.shape[0]
            keys = key_cache[table].reshape(batch, -1, *key_cache.shape[2:]).transpose(1, 2)
            values = value_cache[table].reshape(batch, -1, *value_cache.shape[2:]).transpose(1, 2)
            query = q[index][:, :, None, :]  # [B, H, 1, D]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=masks[window], scale=scale, enable_gqa=gqa)
            out[index] = attn[:, :, 0, :]
        for start, length, block_ids, masks in meta.extra["prefills"]:
            keys = key_cache[block_ids].reshape(1, -1, *key_cache.shape[2:]).transpose(1, 2)
            values = value_cache[block_ids].reshape(1, -1, *value_cache.shape[2:]).transpose(1, 2)
            query = q[start : start + length].transpose(0, 1)[None]  # [1, H, L, D]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=masks[window], scale=scale, enable_gqa=gqa)
            out[start : start + length] = attn[0].transpose(0, 1)
        return out


class FlashAttention:
    """flash-attn varlen on CUDA.

    flash-attn 2 reads a paged cache directly only when the block size is a multiple of 256; for
    smaller blocks the step's context is gathered into a packed varlen buffer first.
    """

    name = "flash"

    def __init__(self, windows: set[int | None], block_size: int, varlen_func=None):
        if varlen_func is None:
            from flash_attn import flash_attn_varlen_func as varlen_func
        self.varlen = varlen_func
        self.block_size = block_size
        self.paged = block_size % 256 == 0

    def prepare(self, requests: list[AttentionRequest], device) -> AttentionMetadata:
        bs = self.block_size
        slot_blocks, slot_offsets = _slot_tensors(requests, bs, device)
        query_lens = [r.num_query_tokens for r in requests]
        context_lens = [r.context_len for r in requests]
        cu_q = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        cu_k = torch.tensor([0] + context_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        extra = {"cu_q": cu_q, "cu_k": cu_k, "max_q": max(query_lens), "max_k": max(context_lens)}
        if self.paged:
            max_blocks = max(len(r.block_ids) for r in requests)
            table = torch.zeros((len(requests), max_blocks), dtype=torch.int32)
            for i, r in enumerate(requests):
                table[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
            extra["block_table"] = table.to(device)
        else:
            gather_blocks, gather_offsets = [], []
            for r in requests:
                for pos in range(r.context_len):
                    gather_blocks.append(r.block_ids[pos // bs])
                    gather_offsets.append(pos % bs)
            extra["gather"] = (
                torch.tensor(gather_blocks, dtype=torch.long, device=device),
                torch.tensor(gather_offsets, dtype=torch.long, device=device),
            )
        return AttentionMetadata(slot_blocks, slot_offsets, extra)

    def forward(self, q, k, v, cache: KVCache, layer: int, meta: AttentionMetadata, window, scale) -> torch.Tensor:
        key_cache, value_cache = cache.key(layer), cache.value(layer)
        key_cache[meta.slot_blocks, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, meta.slot_offsets] = v
        x = meta.extra
        window_size = (-1, -1) if window is None else (window - 1, 0)
        if self.paged:
            keys, values, block_table = key_cache, value_cache, x["block_table"]
        else:
            blocks, offsets = x["gather"]
            keys, values, block_table = key_cache[blocks, offsets], value_cache[blocks, offsets], None
        kwargs = {"block_table": block_table} if block_table is not None else {}
        return self.varlen(
            q, keys, values, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"],
            softmax_scale=scale, causal=True, window_size=window_size, **kwargs,
        )


def make_attention(backend: str, device: torch.device, windows: set[int | None], block_size: int):
    """``auto`` picks flash-attn on CUDA when it is installed, the torch path otherwise."""
    if backend == "auto":
        backend = "torch"
        if device.type == "cuda":
            try:
                import flash_attn  # noqa: F401

                backend = "flash"
            except ImportError:
                pass
    if backend == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flash' needs a CUDA device")
        return FlashAttention(windows, block_size)
    return TorchAttention(windows, block_size)
