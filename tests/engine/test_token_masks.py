"""``TokenMasks``: each constrained row ends with exactly its allowed tokens finite (sparse rows
rebuilt from their allowed tokens, dense rows masked), and a row whose grammar may end allows all
of the request's stop tokens -- one whose grammar may not, only those it takes as text."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from common.engine.structured import masking
from common.engine.structured.masking import TokenMasks


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The C kernel, and the torch path a machine without a compiler takes (the same for every
    example: the fixture only chooses the path)."""
    if request.param == "kernel":
        assert masking._kernel(torch.zeros(1, 8)) is not None, "the C kernel did not build"
    else:
        monkeypatch.setattr(masking, "_kernel", lambda logits: None)
    return request.param

VOCAB = 1000  # not a multiple of 32: the last word is partly outside the vocabulary


class FixedSet:
    def __init__(self, allowed, ends=True):
        self.allowed, self.ends = allowed, ends

    def may_end(self):
        return self.ends

    def fill_bitmask(self, bitmask, row):
        bits = np.zeros(bitmask.shape[1] * 32, dtype=np.uint8)
        bits[list(self.allowed)] = 1
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.sets(st.integers(0, VOCAB - 1), max_size=20),
                          st.sets(st.integers(0, VOCAB - 1), min_size=300, max_size=900)), min_size=1, max_size=4),
       st.sets(st.integers(0, VOCAB - 1), max_size=3))
def test_rows_keep_exactly_their_allowed_tokens(path, allowed_sets, stops):
    logits = torch.randn(len(allowed_sets) + 1, VOCAB)
    before = logits.clone()
    rows = list(range(1, len(allowed_sets) + 1))  # row 0 is unconstrained
    TokenMasks().apply(logits, rows, [FixedSet(a) for a in allowed_sets], [tuple(stops)] * len(rows))
    assert torch.equal(logits[0], before[0])
    for row, allowed in zip(rows, allowed_sets):
        expected = set(allowed) | (set(stops) if set(allowed) & set(stops) else set())
        finite = set(torch.isfinite(logits[row]).nonzero()[:, 0].tolist())
        assert finite == expected
        keep = sorted(expected)
        assert torch.equal(logits[row, keep], before[row, keep])


def test_bit_31_of_a_word(path):
    logits = torch.zeros(1, 64)
    TokenMasks().apply(logits, [0], [FixedSet({31, 63})], [(5,)])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [31, 63]
    logits = torch.zeros(1, 64)
    TokenMasks().apply(logits, [0], [FixedSet({5})], [(5, 63)])  # 5 is a stop token: 63 too
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [5, 63]


def test_min_tokens_holds_the_stop_tokens_back_unless_the_grammar_can_only_end(path):
    logits = torch.zeros(2, 64)
    # row 0: the grammar allows 3, 5 (a stop token) and more; row 1: only 5 (its grammar is complete)
    TokenMasks().apply(logits, [0, 1], [FixedSet({3, 5}), FixedSet({5})], [(5, 63), (5, 63)], [True, True])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [3]
    assert torch.isfinite(logits[1]).nonzero()[:, 0].tolist() == [5, 63]


def test_a_stop_token_the_grammar_takes_as_text_does_not_open_the_others(path):
    """Mid-output, the grammar allows 5 and 7 -- the user's stop token, as text: EOS (2) stays
    masked (it was allowed too, and sampling it failed the request)."""
    logits = torch.zeros(2, 64)
    TokenMasks().apply(logits, [0, 1], [FixedSet({5, 7}, ends=False), FixedSet({5, 7}, ends=True)], [(2, 7), (2, 7)])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [5, 7]
    assert torch.isfinite(logits[1]).nonzero()[:, 0].tolist() == [2, 5, 7]
