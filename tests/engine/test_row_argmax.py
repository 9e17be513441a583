"""Each row's maximum and first maximal index (``common.engine.row_argmax``): exactly what
``torch.max(x, dim=-1)`` gives, ties, NaN, infinities and signed zeros included; the greedy
sampler takes it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine import row_argmax
from common.engine.row_argmax import row_max

needs_kernel = pytest.mark.skipif(row_argmax._kernel() is None, reason="no C compiler for the kernel")
VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 2.5, float("inf"), float("-inf"), float("nan")])


def assert_same_as_torch(x: torch.Tensor) -> None:
    values, indices = row_max(x)
    expected_values, expected_indices = x.max(dim=-1)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(values.isnan(), expected_values.isnan())
    assert torch.equal(values.nan_to_num(), expected_values.nan_to_num())
    assert torch.equal(values.signbit(), expected_values.signbit())


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda rows: st.integers(1, 70).flatmap(
    lambda n: st.lists(st.lists(VALUES, min_size=n, max_size=n), min_size=rows, max_size=rows))))
def test_rows_of_ties_nans_infinities_and_signed_zeros_match_torch_max(rows):
    """Widths below, at and past the 16 lanes, and a tail: few distinct values, so ties are everywhere."""
    assert_same_as_torch(torch.tensor(rows, dtype=torch.float32))


@needs_kernel
@pytest.mark.parametrize("at", [0, 15, 16, 131_071, 262_143])
def test_a_vocabulary_wide_row_finds_its_maximum_anywhere(at):
    gen = torch.Generator().manual_seed(at)
    x = torch.randn(3, 262_144, generator=gen)
    x[1, at] = 100.0
    x[2, at] = float("nan")
    x[2, -1] = float("nan")  # the first NaN counts
    assert_same_as_torch(x)
    assert_same_as_torch(x[:, : 262_144 - 5])  # a strided view: rows 5 floats longer than they are read


@needs_kernel
def test_the_greedy_sampler_takes_the_kernel_for_fp32_logits_only():
    from common.engine.sampler import _row_max_and_argmax
    from common.engine.sampling_params import SamplingParams

    class Row:  # what ``_row_max_and_argmax`` reads of a sampling request
        sampling_params = SamplingParams(temperature=0.0)

    logits = torch.randn(4, 1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        values, indices = _row_max_and_argmax(logits, [Row] * 4)
    assert row_argmax.PROFILER_LABEL in {event.key for event in prof.key_averages()}
    assert torch.equal(indices, logits.argmax(dim=-1))
    values, indices = row_max(logits.double())  # torch's own for other dtypes
    assert values.dtype == torch.float64 and torch.equal(indices, logits.argmax(dim=-1))
