"""The attention backends' shared interface: the packed batch each one sees, and the step metadata
built from it (``step_layout``, ``PagedMetadata``).  The backends are ``backend_cpu`` (a C kernel
that reads the cache in place), ``backend_torch`` (the reference, and the CPU fallback),
``backend_flash`` and ``backend_triton`` (CUDA); ``selection.make_attention`` picks one.

All backends see the same packed batch: the new tokens of every scheduled request laid end to
end, no padding between requests::

    tokens   [ r0 chunk (37 tokens) | r1 decode | r2 decode | r3 chunk (12) ]
    positions  p0 .. p0+36            q1          q2          p3 .. p3+11

Each layer first writes the new K/V into the cache slots of its tokens, then every query attends
to its request's cached keys up to its own position (and only the last ``window`` of them on
sliding-window layers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionRequest:
    """One request's slice of the packed batch, as attention needs it."""

    query_start: int  # index of its first token in the packed batch
    num_query_tokens: int
    context_len: int  # tokens with KV after this step (cached + new)
    block_ids: list[int]
    table_row: int | None = None  # its row in the persistent block table (``common.engine.kv.block_table``), if any


def trailing_queries(requests: list[AttentionRequest], counts: list[int]) -> list[AttentionRequest]:
    """Each request's last ``counts[i]`` query tokens as a packed batch of their own (a request
    with a count of 0 left out): the same context and blocks, fewer queries -- what a step's last
    layer attends for when only those rows go on (``OutputRows``)."""
    out: list[AttentionRequest] = []
    start = 0
    for request, count in zip(requests, counts):
        if not 0 <= count <= request.num_query_tokens:
            raise ValueError(f"trailing_queries: {count} of a request's {request.num_query_tokens} queries")
        if count:
            out.append(AttentionRequest(start, count, request.context_len, request.block_ids, request.table_row))
            start += count
    return out


@dataclass
class OutputRows:
    """The rows of a packed batch whose final hidden states a step needs, where that is fewer
    than all of its tokens (a prompt chunk samples at its last token, or not at all): the model's
    last layer writes every token's K/V but attends, and computes everything after attention, for
    these rows alone.  ``rows``: their indices in the batch, each request's being the last of its
    slice (``trailing_queries``); ``meta``: the backend's metadata for that smaller batch, ``None``
    when no row is wanted."""

    rows: torch.Tensor
    meta: object | None


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
        slot_offsets  int64 [num_tokens]            and its offset in that block
    """

    block_table: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    max_query_len: int
    max_context: int


def step_layout(requests: list[AttentionRequest], block_size: int, block_table=None) -> StepLayout:
    """Vectorised: no per-token Python loop, and in numpy (a decode step's dozen small array ops
    cost microseconds there, tens of them each as torch ops: ~0.3 ms of an 8-row decode step).
    With ``block_table`` (the KV manager's persistent ``BlockTable``) and every request on a row
    of it, the step's table is one gather of those rows; otherwise it is built from each request's
    ``block_ids``."""
    num = len(requests)
    max_blocks = max(len(r.block_ids) for r in requests)
    if block_table is not None and all(r.table_row is not None for r in requests):
        table = block_table.gather([r.table_row for r in requests], max_blocks)
    else:
        table = torch.zeros((num, max_blocks), dtype=torch.int32)
        for i, r in enumerate(requests):
            table[i, : len(r.block_ids)] = torch.as_tensor(r.block_ids, dtype=torch.int32)
    new = np.fromiter((r.num_query_tokens for r in requests), dtype=np.int32, count=num)
    context = np.fromiter((r.context_len for r in requests), dtype=np.int32, count=num)
    query_start = np.zeros(num + 1, dtype=np.int32)
    np.cumsum(new, out=query_start[1:])
    token_request = np.repeat(np.arange(num), new)
    positions = (np.arange(int(query_start[-1]), dtype=np.int64) - query_start[token_request]
                 + (context - new)[token_request])
    slot_blocks = table.numpy()[token_request, positions // block_size].astype(np.int64)
    return StepLayout(table, torch.from_numpy(query_start), torch.from_numpy(context), torch.from_numpy(positions),
                      torch.from_numpy(slot_blocks), torch.from_numpy(positions % block_size), int(new.max()),
                      int(context.max()))


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
        slots = step.slot_blocks * block_size + step.slot_offsets
        return cls(
            slots=slots.to(device),
            block_table=step.block_table.to(device),
            seq_lens=step.context_lens.to(device),
            query_start=step.query_start.to(device),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_context,
        )


FLASH_PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2 reads a paged cache only in blocks of a multiple of this


def flash_pages(block_size: int) -> bool:
    """Can flash-attn 2 read a paged cache of this block size (``block_table``)?"""
    return block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0
