"""A worker's KV cache as the KV transfer sees it: one cache per tensor-parallel rank, each holding
a range of the model's kv heads, and which rank's heads go where between two such workers.

    prefill TP=2 (4 kv heads)           decode TP=1              decode TP=2
    rank 0: heads [0, 2)  ---------->   rank 0: heads [0, 4)      rank 0: heads [0, 2)
    rank 1: heads [2, 4)  ---------->   (two pieces per block)    rank 1: heads [2, 4)

Every rank's cache has the same block ids (rank 0's scheduler hands them out), so a transfer is a
list of block runs, and each run travels as one piece per (receiving rank, sending rank) pair whose
heads overlap: exactly the heads the receiving rank owns, from a rank that holds them.  A piece
that is a rank's whole share is one contiguous region of its cache (no copy); a part of a share is
copied into a staging buffer on the way (split at the sender, scattered at the receiver).  With
fewer kv heads than ranks, heads are replicated: each receiving rank gets its own copy, from the
holders in turn.

Rank 0 of a tensor-parallel worker holds every rank's cache (``parallel/shared_kv.py`` maps the
others' memory into its process), so one connection between two workers carries all the pieces.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.engine.kv.kv_cache import KVCache, KVLayout
from common.engine.structs import replace

HeadRange = tuple[int, int]  # [start, stop) in the model's kv heads


@dataclass(frozen=True)
class Piece:
    """Heads ``[head_start, head_end)`` of each block go from ``src_rank``'s cache to ``dst_rank``'s."""

    dst_rank: int
    src_rank: int
    head_start: int
    head_end: int


def check_head_ranges(ranges: list[HeadRange], num_kv_heads: int) -> list[str]:
    """What is wrong with a worker's head ranges (empty if nothing): each within the model's heads,
    and together covering every head."""
    problems = []
    if not ranges:
        return ["no ranks"]
    covered: set[int] = set()
    for rank, (start, stop) in enumerate(ranges):
        if not 0 <= start < stop <= num_kv_heads:
            problems.append(f"rank {rank} holds heads [{start}, {stop}), not a range inside [0, {num_kv_heads})")
        covered.update(range(max(start, 0), min(stop, num_kv_heads)))
    missing = sorted(set(range(num_kv_heads)) - covered)
    if missing and not problems:
        problems.append(f"no rank holds kv heads {missing[:8]}")
    return problems


def transfer_plan(src: list[HeadRange], dst: list[HeadRange]) -> list[Piece]:
    """The pieces that give every receiving rank exactly its heads, each from one sending rank that
    holds it (a replicated head from its holders in turn).  Raises ``ValueError`` if a receiving
    rank needs a head no sending rank holds."""
    pieces: list[Piece] = []
    for dst_rank, (start, stop) in enumerate(dst):
        for head in range(start, stop):
            holders = [rank for rank, (s, e) in enumerate(src) if s <= head < e]
            if not holders:
                raise ValueError(f"receiving rank {dst_rank} owns kv head {head}, which no sending rank holds")
            src_rank = holders[dst_rank % len(holders)]
            last = pieces[-1] if pieces else None
            if last and last.dst_rank == dst_rank and last.src_rank == src_rank and last.head_end == head:
                pieces[-1] = dataclasses.replace(last, head_end=head + 1)
            else:
                pieces.append(Piece(dst_rank, src_rank, head, head + 1))
    return pieces


class KVShards:
    """The caches of one worker's ranks (index = rank) and the kv heads each holds.

    ``layout`` is the model's: ``num_kv_heads`` counts every head, not a rank's share; it is what two
    workers compare before any byte moves.  All caches have the same block ids and local shape."""

    def __init__(self, caches: list[KVCache], head_ranges: list[HeadRange], num_kv_heads: int):
        if len(caches) != len(head_ranges):
            raise ValueError(f"{len(caches)} caches but {len(head_ranges)} head ranges")
        problems = check_head_ranges(head_ranges, num_kv_heads)
        if problems:
            raise ValueError("; ".join(problems))
        for cache, (start, stop) in zip(caches, head_ranges):
            if cache.layout.num_kv_heads != stop - start or cache.num_blocks != caches[0].num_blocks:
                raise ValueError("every rank's cache must hold its heads and the same block ids")
        self.caches = caches
        self.head_ranges = [tuple(r) for r in head_ranges]
        self.layout: KVLayout = replace(caches[0].layout, num_kv_heads=num_kv_heads)

    @classmethod
    def single(cls, cache: KVCache) -> "KVShards":
        """A worker without tensor parallelism: one cache with every head."""
        return cls([cache], [(0, cache.layout.num_kv_heads)], cache.layout.num_kv_heads)

    @property
    def num_blocks(self) -> int:
        return self.caches[0].num_blocks

    @property
    def num_ranks(self) -> int:
        return len(self.caches)

    def head_nbytes(self, rank: int) -> int:
        """Bytes of one kv head in one block of ``rank``'s cache (every layer, K and V)."""
        cache = self.caches[rank]
        return cache.block_nbytes // cache.layout.num_kv_heads

    def is_whole_share(self, rank: int, head_start: int, head_end: int) -> bool:
        return (head_start, head_end) == self.head_ranges[rank]

    def heads_view(self, rank: int, first_block_id: int, count: int, head_start: int, head_end: int) -> torch.Tensor:
        """Blocks ``first .. first+count-1`` of ``rank``'s cache, heads ``[head_start, head_end)``
        (model numbering), as a ``[count, layers, 2, block_size, heads, head_dim]`` view (no copy;
        contiguous only when the heads are the rank's whole share)."""
        start, stop = self.head_ranges[rank]
        if not start <= head_start < head_end <= stop:
            raise ValueError(f"rank {rank} holds heads [{start}, {stop}), not [{head_start}, {head_end})")
        cache = self.caches[rank]
        if first_block_id < 0 or first_block_id + count > cache.num_blocks:
            raise ValueError(f"blocks {first_block_id}..{first_block_id + count - 1} outside a "
                             f"{cache.num_blocks}-block cache")
        return cache.blocks(first_block_id, count)[..., head_start - start : head_end - start, :]
