"""Block pool and KV cache manager on tiny pools, with exact block ids."""
import pytest

from common.engine.block_pool import BlockPool
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.prefix_hash import hash_block_tokens, hash_prompt_blocks
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool):
    return [b.block_id for b in pool.free_queue]


def test_allocate_hands_out_blocks_in_order_and_refuses_when_short():
    pool = BlockPool(4)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert pool.allocate(2) is None  # nothing taken on failure
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_freed_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(5)
    blocks = pool.allocate(3)  # 0, 1, 2
    pool.free(reversed(blocks))  # a request frees tail first
    assert free_order(pool) == [3, 4, 2, 1, 0]
    # The next allocations use never-used blocks first, then the old tail before its head.
    assert ids(pool.allocate(3)) == [3, 4, 2]
    pool.check_integrity()


def test_cached_block_survives_free_and_is_evicted_lru_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    ha, hb = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.commit(a, ha, [1, 2])
    pool.commit(b, hb, [3, 4])
    pool.free([a])  # freed first: least recently used
    pool.free([b])
    assert pool.lookup(ha, [1, 2]) is a and pool.lookup(hb, [3, 4]) is b
    stored, removed = pool.take_events()
    assert stored == [ha, hb] and removed == []
    (first,) = pool.allocate(1)
    assert first is a and pool.lookup(ha, [1, 2]) is None and pool.lookup(hb, [3, 4]) is b
    assert pool.take_events() == ([], [ha])
    pool.check_integrity()


def test_hit_in_free_queue_is_revived_by_touch():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(None, [7, 8])
    pool.commit(a, h, [7, 8])
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([a])  # a second sharer
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_integrity()


def test_lookup_verifies_tokens_not_just_the_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.commit(a, h, [1, 2])
    assert pool.lookup(h, [1, 3]) is None  # same hash, different tokens: a collision is no hit


def test_double_free_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_hashes_chain_and_are_stable():
    tokens = list(range(10))
    hashes = hash_prompt_blocks(tokens, 4)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    # Same tokens after another prefix give another hash: a hash names its whole prefix.
    assert hash_prompt_blocks([99] * 4 + tokens[4:8], 4)[1] != hashes[1]
    # Stable across processes and runs (never Python's salted hash()).
    assert hash_block_tokens(None, [1, 2, 3]).hex() == hash_block_tokens(None, [1, 2, 3]).hex()
    assert len(hashes[0]) == 16


def _request(rid, tokens, max_tokens=8):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def test_manager_grows_tables_commits_full_blocks_and_finds_prefixes():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    first = _request("a", list(range(10)))
    assert ids(kv.allocate_slots(first, 10)) == [0, 1, 2]
    first.num_computed_tokens = 10
    kv.commit(first)
    assert len(pool.cached) == 2  # two full blocks; the partial third is not cached
    # A second request sharing 9 tokens hits the first two blocks only.
    second = _request("b", list(range(9)) + [99])
    hits = kv.find_cached_prefix(second)
    assert ids(hits) == [0, 1]
    assert ids(kv.allocate_slots(second, 2, hits)) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert pool.blocks[0].ref_cnt == 2
    kv.free("a")
    kv.free("b")
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_manager_never_hits_the_last_token():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=4)
    first = _request("a", list(range(8)))
    kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.commit(first)
    same = _request("b", list(range(8)))
    # Both blocks are cached, but the last token must be computed to get logits.
    assert ids(kv.find_cached_prefix(same)) == [0]


def test_manager_reserve_blocks_refuses_without_changes():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=2)
    req = _request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(req, 5, reserve_blocks=2) is None
    assert kv.block_ids("a") == [] and pool.num_free_blocks == 4
    assert ids(kv.allocate_slots(req, 5, reserve_blocks=1)) == [0, 1, 2]
