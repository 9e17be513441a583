"""RotaryEmbedding.cos_sin: CPU positions below TABLE_POSITIONS come from tables, to the bit the values
computed for those positions alone (the forward's rope must not move with how it was looked up)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.models import rotary
from common.engine.models.rotary import RotaryEmbedding


def _embedding() -> RotaryEmbedding:
    def freqs(base: float) -> tuple[float, ...]:
        return tuple((1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).tolist())

    # Gemma 3's two layer types, one with an attention scaling (as YaRN's) to take the other branch
    return RotaryEmbedding({"full_attention": (freqs(1e6), 1.0), "sliding_attention": (freqs(1e4), 0.75)},
                           torch.device("cpu"))


@settings(max_examples=60, deadline=None)
@given(positions=st.lists(st.integers(0, rotary.TABLE_POSITIONS + 64), min_size=1, max_size=40),
       layer_type=st.sampled_from(["full_attention", "sliding_attention"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_looked_up_positions_equal_computed_ones(positions, layer_type, dtype):
    embedding = _embedding()
    ids = torch.tensor(positions)
    cos, sin = embedding.cos_sin(ids, layer_type, dtype)
    want_cos, want_sin = embedding.computed(ids, layer_type, dtype)
    assert cos.dtype == dtype and cos.shape == (len(positions), 64)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_tables_grow_with_the_positions_seen_and_stop_at_the_cap():
    embedding = _embedding()
    embedding.cos_sin(torch.tensor([3, 5]), "full_attention", torch.float32)
    small = embedding._tables[("full_attention", torch.float32)][0].shape[0]
    assert small == rotary._FIRST_TABLE
    later = torch.tensor([small + 10, 7])  # past the table: it grows, the old rows stay what they were
    cos, _ = embedding.cos_sin(later, "full_attention", torch.float32)
    assert embedding._tables[("full_attention", torch.float32)][0].shape[0] == 2 * small
    assert torch.equal(cos, embedding.computed(later, "full_attention", torch.float32)[0])
    beyond = torch.tensor([rotary.TABLE_POSITIONS + 1])  # computed, no table that large
    cos, _ = embedding.cos_sin(beyond, "full_attention", torch.float32)
    assert embedding._tables[("full_attention", torch.float32)][0].shape[0] <= rotary.TABLE_POSITIONS
    assert torch.equal(cos, embedding.computed(beyond, "full_attention", torch.float32)[0])
    # a table row is the position's own: off by one would give the neighbour's angle
    table_cos = embedding._tables[("full_attention", torch.float32)][0]
    assert not torch.equal(table_cos[1:9], embedding.computed(torch.arange(0, 8), "full_attention", torch.float32)[0])
