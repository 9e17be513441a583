"""Block tables of requests on top of the block pool: prefix lookup, growth, commit and release.

    request "a" (block_size 4), 10 tokens computed:
        tokens       [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..]
        block table  [     12     |      5      |     31     ]   append-only
        committed     hash(…)       hash(…)       (partial: not hashed)
"""
from __future__ import annotations

from collections import Counter

from common.engine.kv.block_pool import BlockPool, KVCacheBlock
from common.engine.kv.block_table import BlockTable
from common.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the mapping ``request_id -> block table``; the scheduler is its only caller."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, rows of one persistent tensor grown in place with them,
        # which steps gather instead of rebuilding a table from the blocks (``common.engine.kv.block_table``).
        self.table = BlockTable()
        self._num_committed: dict[str, int] = {}
        # Extra references held outside any block table (the prefill role pins blocks while their
        # bytes are on the wire), by block id: every reference has a known owner.
        self.pins: Counter[int] = Counter()

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """Leading blocks of the request already in the prefix cache, each verified against its
        parent hash, its tokens and the request's extra keys (see ``BlockPool.lookup``).

        Never the whole sequence: the last token is always computed so there are logits to sample.
        Nothing for a request that still scores its prompt (``Request.scores_prompt``: every
        position is computed).
        """
        if not self.pool.enable_caching or request.scores_prompt:
            return []
        bs = self.block_size
        hashes = request.update_block_hashes(bs)
        max_blocks = (request.num_tokens - 1) // bs
        hits = []
        for index, block_hash in enumerate(hashes[:max_blocks]):
            parent = hashes[index - 1] if index else None
            block = self.pool.lookup(block_hash, parent, request.all_token_ids[index * bs : (index + 1) * bs],
                                     request.extra_keys)
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """How many blocks the request's table lacks for ``num_new_tokens`` more tokens after its
        computed ones."""
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_tokens_after, self.block_size) - len(self.req_to_blocks.get(request.request_id, ())))

    def blocks_for_next_tokens(self, requests: list[Request], budget: int) -> int:
        """The blocks ``requests`` lack for their next step's tokens, taken in turn from ``budget``
        (a prompt's chunk: what the requests before it leave)."""
        needed = 0
        for request in requests:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            needed += self.blocks_needed(request, num_new)
            budget -= num_new
        return needed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: list[KVCacheBlock] = (),
        reserve_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to hold ``num_new_tokens`` more tokens after its computed ones
        (and after ``cached_blocks``, prefix hits being adopted now).

        Returns the newly allocated blocks, or ``None`` — with nothing changed — if that would leave
        fewer than ``reserve_blocks`` free.
        """
        num_cached = len(cached_blocks)
        num_needed = max(0, self.blocks_needed(request, num_cached * self.block_size + num_new_tokens) - num_cached)
        # Adopting a hit that sits in the free queue takes it out of the free count too.
        num_revived = sum(1 for block in cached_blocks if block.ref_cnt == 0) if cached_blocks else 0
        if num_needed + num_revived + reserve_blocks > self.pool.num_free_blocks:
            return None
        if not num_needed and not cached_blocks:
            return []  # the common decode step: the last block still has room
        self.pool.touch(cached_blocks)
        new_blocks = self.pool.allocate(num_needed)
        assert new_blocks is not None, "free count checked above"
        added = [*cached_blocks, *new_blocks]
        table = self.req_to_blocks.setdefault(request.request_id, [])
        table.extend(added)  # append-only: a table is never rebuilt
        self.table.append(request.request_id, [block.block_id for block in added])
        return new_blocks

    def commit(self, request: Request) -> None:
        """Put every block whose tokens are all computed into the prefix cache."""
        if not self.pool.enable_caching:
            return
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        start = self._num_committed.get(request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes(bs)
        for index in range(start, num_full):
            self.pool.commit(blocks[index], hashes[index], hashes[index - 1] if index else None,
                             request.all_token_ids[index * bs : (index + 1) * bs], request.extra_keys)
        self._num_committed[request_id] = num_full

    def pin(self, blocks: list[KVCacheBlock]) -> None:
        """Hold ``blocks`` (already referenced) past their request's end, until ``unpin``."""
        self.pool.touch(blocks)
        self.pins.update(block.block_id for block in blocks)

    def unpin(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            assert self.pins[block.block_id] > 0, f"unpin of {block}, which is not pinned"
            self.pins[block.block_id] -= 1
            if not self.pins[block.block_id]:
                del self.pins[block.block_id]
        self.pool.free(blocks)

    def holds(self, request_id: str) -> bool:
        return bool(self.req_to_blocks.get(request_id))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def check_integrity(self) -> None:
        """Assert the pool's invariants and that every reference on a block is owned: by a block
        table (a block shared through the prefix cache is in several) or by a pin."""
        self.pool.check_integrity()
        owners: Counter[int] = Counter(self.pins)
        for request_id, blocks in self.req_to_blocks.items():
            assert [b.block_id for b in blocks] == self.table.row_ids(request_id) == self.table.ids(request_id), (
                f"the persistent row of {request_id!r} out of sync with its table")
            assert len({b.block_id for b in blocks}) == len(blocks), f"a block is twice in the table of {request_id!r}"
            owners.update(block.block_id for block in blocks)
        assert set(self.table.lengths) == {r for r, b in self.req_to_blocks.items() if b}, "rows without tables"
        for block in self.pool.blocks:
            assert block.ref_cnt == owners[block.block_id], (
                f"{block} has {block.ref_cnt} references but {owners[block.block_id]} owners")

    def block_ids(self, request_id: str) -> list[int]:
        return self.table.ids(request_id)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so the tail is evicted before the head."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.table.release(request_id)
        self._num_committed.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
