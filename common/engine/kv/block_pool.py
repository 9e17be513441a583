"""Fixed-size KV blocks with reference counts and an LRU free queue that keeps cached blocks.

A released block keeps its hash and stays findable through the prefix cache until it is
handed out again.  The free queue is ordered by eviction priority::

    head (evicted first)                                             tail (evicted last)
      [blk 7] <-> [blk 3] <-> [blk 9] <-> ... <-> [blk 4] <-> [blk 2]
       freed long ago                                  freed most recently

Requests free their blocks tail first (``free`` is given the block table reversed), so within one
sequence the tail is evicted before the head and a shared prefix survives longest.

A cached block remembers what its hash stands for -- its parent's hash, its tokens and the extra
keys (model, cache_salt) -- and a hit must match all three, so a hash collision is a miss and
never KV computed for another prefix or another tenant.  The parent check verifies the whole
chain: the parent hash itself was verified the same way one block earlier.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from common.engine.kv.prefix_hash import BlockHash


class KVCacheBlock:
    """Metadata of one KV block; the bytes live in ``KVCache.buffer[block_id]``."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "extra_keys", "prev_free",
                 "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and committed to the prefix cache: its hash and what the hash
        # stands for (a hit compares all of it).
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.extra_keys: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop from the head and removal from the middle."""

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not in the free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every KV block: allocation, reference counting, the prefix cache and eviction.

    Cache changes are recorded as events (``take_events``) so a worker can publish them to the
    Redis prefix index without the pool knowing about Redis -- where ``record_events`` (off, an
    engine nobody publishes for, as the offline one, would keep every hash it ever cached).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.record_events = record_events
        self._stored_events: list[BlockHash] = []
        self._removed_events: list[BlockHash] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (cached or not): what ``allocate`` can hand out."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Take ``num_blocks`` blocks from the head of the free queue, or ``None`` if they do not fit."""
        if num_blocks > self.free_queue.num_free_blocks:
            return None
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int],
               extra_keys: bytes = b"") -> KVCacheBlock | None:
        """The cached block with this hash, if its parent hash (``None`` for a first block), tokens
        and extra keys really match: a hash collision is a miss."""
        block = self.cached.get(block_hash)
        if (block is None or block.parent_hash != parent_hash or block.extra_keys != extra_keys
                or block.token_ids != tuple(token_ids)):
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit that sat in the free queue leaves it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (pass a block table reversed)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def commit(self, block: KVCacheBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
               token_ids: Sequence[int], extra_keys: bytes = b"") -> None:
        """Record a full block in the prefix cache, with what its hash stands for (``parent_hash``:
        ``None`` for a first block).  First writer wins on a duplicate hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds this prefix (or collides with it); this one stays anonymous
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.extra_keys = extra_keys
        self.cached[block_hash] = block
        if self.record_events:
            self._stored_events.append(block_hash)

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Hashes stored and removed since the last call, for the prefix index."""
        stored, removed = self._stored_events, self._removed_events
        self._stored_events, self._removed_events = [], []
        return stored, removed

    def cached_hashes(self) -> list[BlockHash]:
        return list(self.cached)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (e.g. when a worker's role changes)."""
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.record_events:
                self._removed_events.append(block.block_hash)
        block.block_hash = block.parent_hash = block.extra_keys = None
        block.token_ids = None

    def check_integrity(self) -> None:
        """Assert the pool's invariants; for tests and debug builds."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_free_blocks, "free queue length out of sync"
        assert len({b.block_id for b in in_queue}) == len(in_queue), "a block is twice in the free queue"
        for block in self.blocks:
            queued = block.prev_free is not None
            assert block.ref_cnt >= 0, f"negative ref count on {block}"
            assert queued == (block.ref_cnt == 0), f"{block} free-queue membership disagrees with its ref count"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cache index points at {block} with another hash"
