"""Chained hashes of full KV blocks, identical in every process (workers, gateway, Redis).

    block 0: H(ROOT,   tokens[0:bs],    extra)
    block 1: H(hash0,  tokens[bs:2bs],  extra)
    ...

A block's hash therefore names its whole prefix, so "the longest cached prefix" is just the
number of leading hashes found.  ``extra`` (``block_extra_keys``) names the model and the
request's optional ``cache_salt``: requests with different salts never share a block, in a
worker's prefix cache or in the Redis index.

H is SHA-256 over a fixed, unambiguous byte encoding (every variable-length field is
length-prefixed).  A cryptographic hash because a client chooses the tokens: with a fast
non-cryptographic hash it could craft a prompt whose block collides with someone else's.  A
collision still never serves wrong KV (the block pool compares the parent hash, the tokens and the
extra keys of every hit), but it must not be something a client can aim for.  Python's ``hash()``
is salted per process and would differ between machines.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

BlockHash = bytes  # HASH_LEN bytes
HASH_LEN = 32
ROOT_HASH: BlockHash = b"\x00" * HASH_LEN
MAX_CACHE_SALT_LEN = 256  # characters of a request's cache_salt (vLLM's field)

_TOKEN_DTYPE = np.dtype("<u4")  # token ids are checked to be in [0, vocab) before they are hashed


def block_extra_keys(model_id: str, cache_salt: str | None = None) -> bytes:
    """What every block hash of a request covers besides its tokens: the model and the salt.

    ``None`` and no salt are the same; an empty salt is refused where requests enter."""
    salt = (cache_salt or "").encode()
    model = model_id.encode()
    return len(model).to_bytes(4, "little") + model + len(salt).to_bytes(4, "little") + salt


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    return _hash(parent_hash or ROOT_HASH, np.asarray(token_ids, dtype=_TOKEN_DTYPE).tobytes(), extra_keys)


def _hash(parent: BlockHash, token_bytes: bytes, extra_keys: bytes) -> BlockHash:
    hasher = hashlib.sha256(parent)
    hasher.update(len(token_bytes).to_bytes(4, "little"))
    hasher.update(token_bytes)
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
    begin = len(hashes) * block_size
    end = len(token_ids) // block_size * block_size
    if end <= begin:
        return hashes
    data = np.asarray(token_ids[begin:end], dtype=_TOKEN_DTYPE).tobytes()  # one conversion for all blocks
    step = block_size * _TOKEN_DTYPE.itemsize
    parent = hashes[-1] if hashes else ROOT_HASH
    for offset in range(0, len(data), step):
        parent = _hash(parent, data[offset : offset + step], extra_keys)
        hashes.append(parent)
    return hashes
