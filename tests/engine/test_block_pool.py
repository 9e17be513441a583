"""Block pool and KV cache manager on tiny pools, with exact block ids."""
import hashlib

import pytest

from common.engine.kv.block_pool import BlockPool
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.kv import prefix_hash
from common.engine.kv.prefix_hash import block_extra_keys, hash_block_tokens, hash_prompt_blocks
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
    pool = BlockPool(3, record_events=True)
    a, b, c = pool.allocate(3)
    ha, hb = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.commit(a, ha, None, [1, 2])
    pool.commit(b, hb, None, [3, 4])
    pool.free([a])  # freed first: least recently used
    pool.free([b])
    assert pool.lookup(ha, None, [1, 2]) is a and pool.lookup(hb, None, [3, 4]) is b
    stored, removed = pool.take_events()
    assert stored == [ha, hb] and removed == []
    (first,) = pool.allocate(1)
    assert first is a and pool.lookup(ha, None, [1, 2]) is None and pool.lookup(hb, None, [3, 4]) is b
    assert pool.take_events() == ([], [ha])
    pool.check_integrity()


def test_a_pool_nobody_publishes_for_keeps_no_events():
    """The offline engine never takes them: each hash cached or evicted was kept for good."""
    pool = BlockPool(2)
    for i in range(50):
        (block,) = pool.allocate(1)
        pool.commit(block, hash_block_tokens(None, [i]), None, [i])
        pool.free([block])
    assert pool.take_events() == ([], []) and len(pool.cached) == 2


def test_reset_forgets_only_the_cached_blocks_no_request_holds():
    pool = BlockPool(3, record_events=True)
    held, free = pool.allocate(2)
    h_held, h_free = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.commit(held, h_held, None, [1, 2])
    pool.commit(free, h_free, None, [3, 4])
    pool.free([free])
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.lookup(h_free, None, [3, 4]) is None and pool.lookup(h_held, None, [1, 2]) is held
    assert pool.take_events() == ([], [h_free]) and pool.cached_hashes() == [h_held]
    pool.check_integrity()


def test_hit_in_free_queue_is_revived_by_touch():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(None, [7, 8])
    pool.commit(a, h, None, [7, 8])
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([a])  # a second sharer
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_integrity()


def test_lookup_verifies_tokens_parent_and_extra_keys_not_just_the_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    parent, h, salted = hash_block_tokens(None, [0, 0]), hash_block_tokens(None, [1, 2]), block_extra_keys("m", "s")
    pool.commit(a, h, parent, [1, 2], salted)
    assert pool.lookup(h, parent, [1, 2], salted) is a
    # Same hash but anything else differs: a collision is no hit.
    assert pool.lookup(h, parent, [1, 3], salted) is None
    assert pool.lookup(h, None, [1, 2], salted) is None
    assert pool.lookup(h, hash_block_tokens(None, [9, 9]), [1, 2], salted) is None
    assert pool.lookup(h, parent, [1, 2], block_extra_keys("m", "other")) is None
    assert pool.lookup(h, parent, [1, 2]) is None


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
    assert len(hashes[0]) == 32
    # Incremental hashing (start_hashes) gives the same chain.
    assert hash_prompt_blocks(tokens, 4, start_hashes=hashes[:1]) == hashes


def test_hashes_are_stable_across_processes_and_releases():
    """Pinned values: the gateway, every worker and Redis must agree on these bytes, in any
    process on any machine (never Python's salted hash()), and a change of encoding is a change
    of the cluster protocol."""
    assert hash_block_tokens(None, [1, 2, 3]).hex() == (
        "883624a8aa40d7e24e56c6ee9a36c7748052e29b58fa0f878b44791bf67ca659")
    salted = hash_prompt_blocks(list(range(8)), 4, block_extra_keys("org/model", "tenant-a"))
    assert [h.hex() for h in salted] == [
        "3af9ec33ef638f1d7d3a99be128aff0906360734007babe2e329b27785082e16",
        "6bbe7b642e364b8d67a2a0e9b102698aad3cc29ac80c99bebb5ee877b9583e77",
    ]
    # The encoding, spelled out: SHA-256(parent | len | tokens as u32 LE | len | extra keys).
    extra = b"\x09\x00\x00\x00org/model\x08\x00\x00\x00tenant-a"
    assert block_extra_keys("org/model", "tenant-a") == extra
    tokens = b"".join(t.to_bytes(4, "little") for t in (4, 5, 6, 7))
    manual = hashlib.sha256(salted[0] + (16).to_bytes(4, "little") + tokens + len(extra).to_bytes(4, "little")
                            + extra).digest()
    assert salted[1] == manual


def test_extra_keys_separate_models_and_salts():
    tokens = list(range(8))
    plain = hash_prompt_blocks(tokens, 4, block_extra_keys("m"))
    assert hash_prompt_blocks(tokens, 4, block_extra_keys("m", None)) == plain
    others = [hash_prompt_blocks(tokens, 4, block_extra_keys(*keys))
              for keys in (("m", "a"), ("m", "b"), ("m2",), ("m2", "a"))]
    assert len({h[0] for h in [plain, *others]}) == 5  # no two share even the first block
    # Field boundaries are encoded: moving characters between model and salt changes the hash.
    assert block_extra_keys("ab", "c") != block_extra_keys("a", "bc")


def _request(rid, tokens, max_tokens=8, extra_keys=b""):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), extra_keys=extra_keys)


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


def _cache(kv, request):
    """Compute ``request``'s prompt (as a step would) and commit its full blocks."""
    kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.commit(request)


def test_manager_shares_blocks_only_within_one_cache_salt():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4)
    tokens = list(range(13))
    _cache(kv, _request("a", tokens, extra_keys=block_extra_keys("m", "tenant-a")))
    assert len(kv.find_cached_prefix(_request("b", tokens, extra_keys=block_extra_keys("m", "tenant-b")))) == 0
    assert len(kv.find_cached_prefix(_request("c", tokens, extra_keys=block_extra_keys("m")))) == 0
    assert len(kv.find_cached_prefix(_request("d", tokens, extra_keys=block_extra_keys("other", "tenant-a")))) == 0
    assert ids(kv.find_cached_prefix(_request("e", tokens, extra_keys=block_extra_keys("m", "tenant-a")))) == [0, 1, 2]


def _colliding_hash(parent, token_bytes, extra_keys):
    """A broken hash that sees only the block's own tokens: blocks with equal tokens collide
    whatever their prefix or salt."""
    return hashlib.sha256(token_bytes).digest()


def test_a_hash_collision_with_another_parent_is_a_miss(monkeypatch):
    monkeypatch.setattr(prefix_hash, "_hash", _colliding_hash)
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4)
    head_a, head_b, shared = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]
    _cache(kv, _request("a", head_a + shared + [0]))  # blocks 0, 1: [head_a][shared]
    _cache(kv, _request("b", head_b + [0]))  # block 3: [head_b]
    probe = _request("probe", head_b + shared + [0])
    # The probe's second hash collides with a's second block (same tokens, other parent) ...
    assert probe.update_block_hashes(4)[1] == pool.blocks[1].block_hash
    # ... but that block's KV was computed after head_a: only the probe's first block is a hit.
    assert ids(kv.find_cached_prefix(probe)) == [3]
    # The same prompt as a, under a salt: every hash collides, every extra key differs.
    assert kv.find_cached_prefix(_request("salted", head_a + shared + [0], extra_keys=b"salt")) == []
    assert ids(kv.find_cached_prefix(_request("same", head_a + shared + [0]))) == [0, 1]
