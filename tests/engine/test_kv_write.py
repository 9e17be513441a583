"""The CPU attention backend's KV writes by ``csrc/kv_write_cpu.c`` (``backend_cpu.write_rows``): the
cache holds the bits torch's indexed assignment gives -- fp32 rows copied, bf16 and fp8 e4m3 caches
rounded as torch rounds (NaN, ties, values past fp8's range) --, rows read in place from a fused
projection's output, and a slot outside the cache refused with nothing written."""
from __future__ import annotations

import pytest
import torch

from common.engine.attention.backend_cpu import _row_writer, write_rows

pytestmark = pytest.mark.skipif(_row_writer() is None, reason="no C compiler for the KV write kernel")

BLOCKS, BLOCK_SIZE, LAYERS, KV_HEADS, HEAD_DIM = 6, 4, 3, 2, 16


def _caches(dtype):
    buffer = torch.zeros(BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
    return buffer, buffer[:, 1, 0], buffer[:, 1, 1]  # layer 1's keys and values, as KVCache views them


def _rows(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v [tokens, KV_HEADS, HEAD_DIM] as views of one fused projection's output (rows strided)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, 3 * KV_HEADS * HEAD_DIM, generator=g) * 300  # past fp8's 448 too
    fused[0, 3] = float("nan")
    fused[1, :8] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.5 + 2 ** -9, 1e-9, -0.0, 464, 480])
    k, v = fused[:, KV_HEADS * HEAD_DIM:].split(KV_HEADS * HEAD_DIM, dim=1)
    return k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_kernel_writes_the_bits_torch_assigns(dtype):
    k, v = _rows(9, seed=1)
    assert k.stride(0) == 3 * KV_HEADS * HEAD_DIM  # read in place, not copied first
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:9]
    blocks, offsets = (slots // BLOCK_SIZE).to(torch.int32), slots % BLOCK_SIZE
    ours, keys, values = _caches(dtype)
    assert write_rows(keys, values, blocks, offsets, k, v)
    torch_buffer, torch_keys, torch_values = _caches(dtype)
    torch_keys[blocks.long(), offsets] = k.to(dtype)
    torch_values[blocks.long(), offsets] = v.to(dtype)
    assert torch.equal(ours.view(torch.uint8), torch_buffer.view(torch.uint8))
    assert ours[:, 1].view(torch.uint8).any() and not ours[:, 0].view(torch.uint8).any()  # layer 1's alone


def test_a_slot_outside_the_cache_is_refused_with_nothing_written():
    k, v = _rows(3, seed=3)
    buffer, keys, values = _caches(torch.float32)
    for blocks, offsets in (([0, 1, BLOCKS], [0, 0, 0]), ([0, 1, 2], [0, BLOCK_SIZE, 1]), ([0, -1, 2], [0, 0, 0])):
        with pytest.raises(IndexError, match="outside the cache"):
            write_rows(keys, values, torch.tensor(blocks), torch.tensor(offsets), k, v)
    assert not buffer.any()


def test_rows_it_does_not_read_are_left_to_the_caller():
    k, v = _rows(2, seed=4)
    buffer, keys, values = _caches(torch.float32)
    blocks, offsets = torch.tensor([0, 1]), torch.tensor([0, 0])
    assert not write_rows(keys, values, blocks, offsets, k.to(torch.bfloat16), v.to(torch.bfloat16))
    wide = torch.randn(2, KV_HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]  # a token's heads not contiguous
    assert not write_rows(keys, values, blocks, offsets, wide, wide)
    assert not buffer.any()
