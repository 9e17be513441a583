"""N-gram prompt lookup against a plain-Python statement of the rule: the longest suffix (min..max
tokens) that occurred earlier, its latest occurrence, and the tokens that followed it."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from types import SimpleNamespace

from common.engine.speculative.ngram import NgramProposer, propose_from


def request(tokens, request_id="r"):
    return SimpleNamespace(request_id=request_id, all_token_ids=tokens)


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    last = len(tokens)
    for n in range(min(max_n, last - 1), min_n - 1, -1):
        suffix = tokens[last - n:]
        for start in range(last - n - 1, -1, -1):  # latest first; never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60), st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_matches_the_rule(tokens, min_n, extra, k):
    max_n = min_n + extra
    got = propose_from(np.array(tokens, dtype=np.int64), min_n, max_n, k) if tokens else []
    assert got == reference(tokens, min_n, max_n, k)


def test_copies_a_quoted_span():
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    tokens = [1, 2, *text, 3, 4, *text[:3]]  # the answer has started to quote the prompt
    assert NgramProposer(2, 4, 1024).propose(request(tokens), 4) == [8, 9, 10, 11]


def test_window_bounds_the_search():
    tokens = [5, 6, 7, 8] + [1] * 20 + [5, 6]
    assert NgramProposer(2, 2, 1024).propose(request(tokens), 2) == [7, 8]
    assert NgramProposer(2, 2, 10).propose(request(tokens), 2) == []  # the earlier "5 6" is out of the window


def test_incremental_history_follows_the_list():
    proposer = NgramProposer(1, 2, 64)
    tokens = [1, 2, 3]
    assert proposer.propose(request(tokens), 2) == []
    tokens += [1]
    assert proposer.propose(request(tokens), 2) == [2, 3]
    tokens += [9, 9]
    assert proposer.propose(request(tokens), 3) == [9]
    proposer.forget("r")
    assert proposer.propose(request([4, 4]), 1) == [4]


@pytest.mark.parametrize("min_n,max_n,window", [(0, 2, 10), (3, 2, 10), (2, 4, 4)])
def test_bad_settings_are_refused(min_n, max_n, window):
    with pytest.raises(ValueError):
        NgramProposer(min_n, max_n, window)
