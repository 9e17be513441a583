"""Drawing one token per row from unnormalised probabilities ``e`` (the sampler's scratch rows,
each row's maximum exactly 1) by inverse CDF, with one uniform number per row.

* ``sample_plain``: over all columns in two levels -- a block of ``BLOCK`` columns chosen by the
  blocks' sums (``block_sums``, fp64), then a column inside it by the block's cumulative sum.
* ``sample_wide_nucleus``: top-p without sorting the row (the boundary bucket of the values' bit
  patterns, then the exact threshold inside it), then ``sample_plain`` over the kept tokens; on
  CPU in fp32 one C kernel (``top_p_kernel``, csrc/top_p_cpu.c) does the three passes.

The uniform numbers: ``seeded_uniform`` for a seeded row (from its seed and output index only, so
its token does not depend on the batch or the worker), one batched draw for the rest
(``uniforms_for``).  ``common.engine.sampler`` decides which rows take which path.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

BLOCK = 1024  # columns per block of the plain path's two-level inverse CDF
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def block_sums(e: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(vocab / BLOCK)] sums of consecutive BLOCK-column blocks, in fp64."""
    n, vocab = e.shape
    full = vocab // BLOCK
    sums = e[:, : full * BLOCK].view(n, full, BLOCK).sum(dim=-1)
    if vocab % BLOCK:
        sums = torch.cat([sums, e[:, full * BLOCK :].sum(dim=-1, keepdim=True)], dim=1)
    return sums.double()


def last_positive(values: torch.Tensor) -> torch.Tensor:
    """Index of the last positive entry of each row (rows are known to have one)."""
    width = values.shape[1]
    return width - 1 - (values > 0).flip(-1).int().argmax(dim=-1)


def sample_wide_nucleus(e: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Top-p without sorting the row: find the nucleus threshold, then sample the kept tokens in
    column order.

    A token is in the nucleus when the mass strictly above it is below ``top_p * total`` (the
    sorted rule).  Values in (0, 1] order as their float bit patterns, so the top 16 bits bucket a
    row monotonically (an exponent and 7 mantissa bits: buckets 1/128 of an octave wide):
        one weighted bincount        -> each bucket's mass, and the mass above each bucket
        the boundary bucket          -> every bucket above it is kept, every one below dropped
        sort only the boundary's tokens -> the exact threshold inside it
    The kept tokens' distribution is the sorted rule's; only the map from the uniform number to a
    token differs (column order), and it is as deterministic.  On CPU in fp32 the same three
    steps run as one C kernel (csrc/top_p_cpu.c), a row per thread, in three passes over the row.
    """
    n, vocab = e.shape
    device = e.device
    kernel = top_p_kernel(e)
    if kernel is not None:
        if e.stride(-1) != 1:
            e = e.contiguous()
        out = torch.empty(n, dtype=torch.int64)
        p32, u64 = top_p.float().contiguous(), uniforms.double().contiguous()
        rc = kernel.top_p_sample(e.data_ptr(), n, vocab, e.stride(0), p32.data_ptr(), u64.data_ptr(),
                                 out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("top-p sampling kernel: scratch allocation failed")
        return out
    buckets = (int(torch.tensor(1.0).view(torch.int32)) >> 16) + 1
    keys = e.view(torch.int32) >> 16
    flat = (keys + (torch.arange(n, device=device, dtype=torch.int32) * buckets)[:, None]).view(-1)
    mass = torch.bincount(flat, weights=e.view(-1), minlength=n * buckets).view(n, buckets).double()
    inclusive = mass.flip(-1).cumsum(-1).flip(-1)  # mass at or above each bucket
    target = top_p.double() * inclusive[:, 0]
    # inclusive falls with the bucket: [0, boundary] are the buckets whose mass-at-or-above reaches target
    boundary = ((inclusive >= target[:, None]).sum(dim=-1) - 1).clamp(min=0)
    above = (inclusive - mass).gather(1, boundary[:, None])[:, 0]  # mass strictly above the boundary bucket
    rows, cols = (keys == boundary.to(torch.int32)[:, None]).nonzero(as_tuple=True)
    values = e[rows, cols]
    order = torch.argsort(values, descending=True, stable=True)
    order = order[torch.argsort(rows[order], stable=True)]  # by row, descending within a row
    rows, values = rows[order], values[order]
    counts = torch.bincount(rows, minlength=n)
    starts = torch.cumsum(counts, 0) - counts
    running = values.double().cumsum(0)
    before = running - values.double() - (running - values.double())[starts][rows]  # within-row mass before
    kept = above[rows] + before < target[rows]
    # the smallest kept value of each row (the bucket's largest is always kept: above < target)
    threshold = torch.full((n,), float("inf"), device=device)
    threshold.scatter_reduce_(0, rows[kept], values[kept], reduce="amin")
    e.masked_fill_(e < threshold[:, None], 0.0)
    return sample_plain(e, block_sums(e), uniforms)


def top_p_kernel(e: torch.Tensor):
    """The compiled top-p kernel for CPU fp32 rows, else ``None`` (the torch path)."""
    if e.device.type != "cpu" or e.dtype != torch.float32:
        return None
    from common.engine.cpu_kernels import load_kernel

    lib = load_kernel("top_p_cpu")
    if lib is not None and lib.top_p_sample.argtypes is None:
        fn = lib.top_p_sample
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    return lib


def sample_plain(e: torch.Tensor, block_sums: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over all columns: pick a block by its sum, then a column inside it."""
    n, vocab = e.shape
    cumulative = block_sums.cumsum(dim=-1)
    target = uniforms * cumulative[:, -1]
    block = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    block = torch.minimum(block, last_positive(block_sums))  # never a block of zeros
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0],
                         torch.zeros_like(target))
    fraction = ((target - before) / block_sums.gather(1, block[:, None])[:, 0]).clamp(0.0, 1.0)
    columns = block[:, None] * BLOCK + torch.arange(BLOCK, device=e.device)[None, :]
    inside = columns < vocab
    segment = torch.where(inside, e.gather(1, columns.clamp(max=vocab - 1)), torch.zeros((), device=e.device))
    segment_cumulative = segment.double().cumsum(dim=-1)
    index = torch.searchsorted(segment_cumulative, (fraction * segment_cumulative[:, -1])[:, None], right=True)[:, 0]
    index = torch.minimum(index, last_positive(segment))
    return block * BLOCK + index


def seeded_uniform(seed: int, output_index: int) -> float:
    """The uniform number in [0, 1) a seeded request uses for its ``output_index``-th token."""
    generator = torch.Generator()
    generator.manual_seed(_splitmix64((seed & _MASK64) ^ _splitmix64(output_index)))
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def _splitmix64(x: int) -> int:
    # A bijective mix, so nearby (seed, index) pairs get unrelated generator states.
    x = (x + 0x9E37_79B9_7F4A_7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def uniforms_for(rows: Sequence, device) -> torch.Tensor:
    """One uniform number per row (``SamplingRequest``s): a row's own ``uniform`` where it has one
    (drawn with its draft: ``speculative.draft_sampling``), seeded rows from (seed, output index),
    the rest in one draw."""
    values = torch.rand(len(rows), dtype=torch.float64)
    for i, row in enumerate(rows):
        seed = row.sampling_params.seed
        drawn = getattr(row, "uniform", None)
        if drawn is not None:
            values[i] = drawn
        elif seed is not None:
            values[i] = seeded_uniform(seed, row.num_output_tokens)
    return values.to(device)
