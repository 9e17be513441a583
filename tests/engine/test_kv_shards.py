"""Which heads go where between tensor-parallel workers (``common/engine/kv/kv_shards.py``)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from common.engine.kv.kv_shards import check_head_ranges, transfer_plan
from common.engine.parallel.tensor_parallel import TensorParallel

NUM_HEADS = 8


def head_ranges(tp: int, kv_heads: int) -> list[tuple[int, int]]:
    return TensorParallel(tp).kv_head_ranges(NUM_HEADS, kv_heads)


@given(kv_heads=st.sampled_from([1, 2, 4, 8]), p=st.sampled_from([1, 2, 4, 8]), d=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=60, deadline=None)
def test_the_plan_gives_each_receiving_rank_its_heads_once_from_holders(kv_heads, p, d):
    src, dst = head_ranges(p, kv_heads), head_ranges(d, kv_heads)
    pieces = transfer_plan(src, dst)
    for rank, (start, stop) in enumerate(dst):
        got = sorted(h for piece in pieces if piece.dst_rank == rank for h in range(piece.head_start, piece.head_end))
        assert got == list(range(start, stop)), f"rank {rank} gets heads {got}, owns [{start}, {stop})"
    for piece in pieces:
        s, e = src[piece.src_rank]
        assert s <= piece.head_start < piece.head_end <= e, "a piece comes from a rank that does not hold it"
    assert len(pieces) == len({(p.dst_rank, p.src_rank) for p in pieces}), "a rank pair split into several frames"




def test_head_ranges_that_leave_a_head_out_or_leave_the_model_are_named():
    assert check_head_ranges([(0, 2), (0, 2)], 4) == ["no rank holds kv heads [2, 3]"]
    assert check_head_ranges([(0, 2), (2, 5)], 4) == ["rank 1 holds heads [2, 5), not a range inside [0, 4)"]
    assert check_head_ranges([(0, 2), (2, 4)], 4) == []
