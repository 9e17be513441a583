"""Chained hashes of full KV blocks, identical in every process (workers, gateway, Redis).

    block 0: H(ROOT,   tokens[0:bs],    extra)
    block 1: H(hash0,  tokens[bs:2bs],  extra)
    ...

A block's hash therefore names its whole prefix, so "the longest cached prefix" is just the
number of leading hashes found.  ``xxh3_128`` over a fixed byte encoding is used: Python's
``hash()`` is salted per process and would differ between machines.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

BlockHash = bytes  # 16 bytes
ROOT_HASH: BlockHash = b"\x00" * 16


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    hasher = xxhash.xxh3_128()
    hasher.update(parent_hash or ROOT_HASH)
    hasher.update(np.asarray(token_ids, dtype="<i4").tobytes())
    hasher.update(len(extra_keys).to_bytes(4, "little"))
    hasher.update(extra_keys)
    return hasher.digest()


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: bytes = b"", start_hashes: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block is not hashed.

    ``start_hashes`` are hashes already known for the leading blocks; only the rest are computed.
    """
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
