"""Paged attention over the block-major KV cache: a C kernel that reads the cache in place (CPU:
``common.engine.attention_cpu``), a pure-torch path (the reference, and the CPU fallback), flash-attn
and Triton (CUDA: ``common.engine.attention_flash`` and ``common.engine.attention_triton``).

All backends see the same packed batch: the new tokens of every scheduled request laid end to
end, no padding between requests::

    tokens   [ r0 chunk (37 tokens) | r1 decode | r2 decode | r3 chunk (12) ]
    positions  p0 .. p0+36            q1          q2          p3 .. p3+11

Each layer first writes the new K/V into the cache slots of its tokens, then every query attends
to its request's cached keys up to its own position (and only the last ``window`` of them on
sliding-window layers).
"""
from __future__ import annotations

import os
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
    table_row: int = -1  # its row in the persistent block table (``common.engine.block_table``), if any


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer; built once by ``AttentionBackend.prepare``."""

    slot_blocks: torch.Tensor  # [num_tokens] block id each new token's KV goes to
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    extra: dict = field(default_factory=dict)


@dataclass
class StepLayout:
    """Where a step's tokens sit, on the CPU, for backends to build their metadata from::

        block_table   int32 [num_seqs, max_blocks]  each request's block ids, zero-padded
        query_start   int32 [num_seqs + 1]          where each request's tokens start in the batch
        context_lens  int32 [num_seqs]              keys per request after this step
        positions     int64 [num_tokens]            each new token's position in its request
        slot_blocks   int64 [num_tokens]            the block each new token's KV goes to
    """

    block_table: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    max_query_len: int


def step_layout(requests: list[AttentionRequest], block_size: int, block_table=None) -> StepLayout:
    """Vectorised: no per-token Python loop. With ``block_table`` (the KV manager's persistent
    ``BlockTable``) and every request on a row of it, the step's table is one gather of those
    rows; otherwise it is built from each request's ``block_ids``."""
    num = len(requests)
    max_blocks = max(len(r.block_ids) for r in requests)
    if block_table is not None and all(r.table_row >= 0 for r in requests):
        table = block_table.gather([r.table_row for r in requests], max_blocks)
    else:
        table = torch.zeros((num, max_blocks), dtype=torch.int32)
        for i, r in enumerate(requests):
            table[i, : len(r.block_ids)] = torch.as_tensor(r.block_ids, dtype=torch.int32)
    new = torch.tensor([r.num_query_tokens for r in requests], dtype=torch.int32)
    context = torch.tensor([r.context_len for r in requests], dtype=torch.int32)
    query_start = torch.zeros(num + 1, dtype=torch.int32)
    torch.cumsum(new, 0, out=query_start[1:])
    token_request = torch.repeat_interleave(torch.arange(num), new.long())
    positions = torch.arange(int(query_start[-1])) - query_start[token_request].long() + (context - new)[token_request].long()
    slot_blocks = table[token_request, positions // block_size].long()
    return StepLayout(table, query_start, context, positions, slot_blocks, int(new.max()))


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


@dataclass
class PagedMetadata:
    """One step's metadata for the kernels that read the paged cache in place (Triton, flash-attn)::

        block_table  int32 [num_seqs, max_blocks]  each request's block ids, zero-padded
        seq_lens     int32 [num_seqs]              keys per request after this step
        query_start  int32 [num_seqs + 1]          where each request's tokens start in the batch
        slots        int64 [num_tokens]            block_id * block_size + offset of each new token
    """

    slots: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, requests: list[AttentionRequest], block_size: int, device, block_table=None) -> "PagedMetadata":
        """From the requests' block ids, or from ``block_table`` (see ``step_layout``)."""
        step = step_layout(requests, block_size, block_table)
        slots = step.slot_blocks * block_size + step.positions % block_size
        return cls(
            slots=slots.to(device),
            block_table=step.block_table.to(device),
            seq_lens=step.context_lens.to(device),
            query_start=step.query_start.to(device),
            max_query_len=step.max_query_len,
            max_seq_len=int(step.context_lens.max()),
        )


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or anywhere under its CPU interpreter (``TRITON_INTERPRET=1``, tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_attention(backend: str, device: torch.device, windows: set[int | None], block_size: int,
                   dtype: torch.dtype = torch.float32):
    """``auto``: on CUDA flash-attn when it is installed and the block size suits its paged KV,
    else Triton; on CPU the C kernel that reads the cache in place (``attention_cpu``) where it
    builds and supports the dtype, else the torch path."""
    device = torch.device(device)
    if backend == "auto":
        backend = "torch"
        if device.type == "cuda":
            backend = "flash" if flash_attn_installed() and flash_pages(block_size) else "triton"
        elif device.type == "cpu":
            from common.engine import attention_cpu

            if attention_cpu.supports(dtype) and attention_cpu.build_kernel() is not None:
                backend = "cpu"
    if backend == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flash' needs a CUDA device")
        from common.engine.attention_flash import FlashAttention

        return FlashAttention(windows, block_size)
    if backend == "triton":
        if not triton_available(device):
            raise ValueError("attention_backend 'triton' needs the triton package and a CUDA device "
                             "(or TRITON_INTERPRET=1, Triton's CPU interpreter, for tests)")
        from common.engine.attention_triton import TritonAttention

        return TritonAttention(windows, block_size)
    if backend == "cpu":
        from common.engine import attention_cpu

        if device.type != "cpu" or not attention_cpu.supports(dtype):
            raise ValueError(f"attention_backend 'cpu' needs a CPU device and float32 or bfloat16, got {device} {dtype}")
        kernel = attention_cpu.build_kernel()
        if kernel is None:
            raise ValueError("attention_backend 'cpu': its kernel could not be built (no C compiler?); see the log")
        return attention_cpu.CpuPagedAttention(windows, block_size, kernel)
    return TorchAttention(windows, block_size)


FLASH_PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2 reads a paged cache only in blocks of a multiple of this


def flash_pages(block_size: int) -> bool:
    """Can flash-attn 2 read a paged cache of this block size (``block_table``)?"""
    return block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0


def flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True
