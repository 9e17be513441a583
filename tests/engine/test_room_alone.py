"""RoomAlone (common/engine/room_alone.py): could a request hold all its blocks with every other
running request preempted, against the blocks held outside running (reservations, pins)?  Unit
examples on a real block pool, on both sides of the cheap bound that answers first."""
from __future__ import annotations

from common.engine.kv.block_pool import BlockPool
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.room_alone import RoomAlone
from common.engine.sampling_params import SamplingParams

BLOCK = 4
POOL = 8


def request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1))


def holding(kv: KVCacheManager, request_id: str, num_blocks: int) -> Request:
    """A request of ``num_blocks`` full blocks that holds them (an outside owner)."""
    owner = request(request_id, num_blocks * BLOCK)
    assert kv.allocate_slots(owner, num_blocks * BLOCK) is not None
    return owner


def test_a_request_fits_alone_in_what_the_outside_owners_leave():
    kv = KVCacheManager(BlockPool(POOL), BLOCK)
    room = RoomAlone(kv)
    holding(kv, "reserved", 3)
    outside = room.outside(["reserved"])
    assert outside.bound == 3 and len(outside.ids) == 3
    assert room.fits(request("five", 5 * BLOCK), outside)  # 5 of the 8 - 3 left
    assert not room.fits(request("six", 6 * BLOCK), outside)
    assert room.fits(request("six", 6 * BLOCK), room.outside([]))  # nothing outside: the whole pool


def test_a_new_outside_owner_takes_its_blocks_from_the_request():
    """fits_after: the blocks a new reservation would take are one less each for the request --
    also when the cheap bound alone cannot answer (no room left by the bound, the exact count
    decides)."""
    kv = KVCacheManager(BlockPool(POOL), BLOCK)
    room = RoomAlone(kv)
    outside = room.outside([])
    five = request("five", 5 * BLOCK)
    assert room.fits_after(five, outside, num_blocks=3, hits=[])  # 5 <= 8 - 3
    assert not room.fits_after(five, outside, num_blocks=4, hits=[])  # 5 > 8 - 4
    holding(kv, "reserved", 2)
    outside = room.outside(["reserved"])
    assert room.fits_after(request("four", 4 * BLOCK), outside, num_blocks=2, hits=[])  # 4 <= 8 - 2 - 2
    assert not room.fits_after(five, outside, num_blocks=2, hits=[])  # 5 > 8 - 2 - 2


def test_a_new_owners_prefix_hits_already_outside_cost_the_request_nothing():
    kv = KVCacheManager(BlockPool(POOL), BLOCK)
    room = RoomAlone(kv)
    holding(kv, "reserved", 2)
    outside = room.outside(["reserved"])
    shared = kv.req_to_blocks["reserved"]
    five = request("five", 5 * BLOCK)
    # The new owner takes 3 blocks, 2 of them hits on blocks already outside: 1 more is gone.
    assert room.fits_after(five, outside, num_blocks=3, hits=list(shared))  # 5 <= 8 - 2 - 1
    assert not room.fits_after(five, outside, num_blocks=3, hits=list(shared[:1]))  # 5 > 8 - 2 - 2


def test_the_request_own_blocks_are_not_counted_as_outside():
    kv = KVCacheManager(BlockPool(POOL), BLOCK)
    room = RoomAlone(kv)
    mine = holding(kv, "mine", 3)
    holding(kv, "reserved", 2)
    outside = room.outside(["reserved", "mine"])  # e.g. a landed request that owns blocks too
    assert room.own(mine) == {block.block_id for block in kv.req_to_blocks["mine"]}
    assert room.fits(request("mine", 6 * BLOCK), outside)  # 6 <= 8 - (5 outside - 3 its own)
