"""Cache regions of block runs: pairing source and destination ids, byte views, checksums."""
from __future__ import annotations

import xxhash

from common.engine.kv.kv_cache import KVCache
from kvtransfer.transport_base import byte_view


def paired_runs(src_block_ids: list[int], dst_block_ids: list[int], max_count: int) -> list[tuple[int, int, int]]:
    """Split into ``(src_first, dst_first, count)`` runs consecutive on *both* sides, so each run
    is one contiguous region in each cache and travels as a single frame."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n and n < max_count:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def run_bytes(cache: KVCache, first_block_id: int, count: int):
    """Flat uint8 view of blocks ``first .. first+count-1`` (no copy)."""
    if first_block_id < 0 or first_block_id + count > cache.num_blocks:
        raise ValueError(f"blocks {first_block_id}..{first_block_id + count - 1} outside a {cache.num_blocks}-block cache")
    return byte_view(cache.blocks(first_block_id, count))


def block_checksums(region, block_nbytes: int) -> list[int]:
    """xxh3-64 of each block in a run region (debugging aid; copies device memory to host)."""
    data = region.cpu().numpy()
    return [xxhash.xxh3_64_intdigest(data[i : i + block_nbytes]) for i in range(0, len(data), block_nbytes)]
