"""The CPU attention backend's KV writes by ``csrc/kv_write_cpu.c`` (``backend_cpu.write_rows``): the
cache holds the bits torch's indexed assignment gives -- fp32 rows copied, bf16 and fp8 e4m3 caches
rounded as torch rounds (NaNs, ties, values past fp8's range) --, rows read in place from a fused
projection's output, a slot outside the cache refused with nothing written, and the engine's own
steps written this way."""
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
    q_width = KV_HEADS * HEAD_DIM  # (a query part as wide as k's: the projection's first third)
    special = torch.tensor([float("nan"), -float("nan"), 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.5 + 2 ** -9,
                            1e-9, -0.0, 464, 480, -1e6, 2 ** -9 + 2 ** -12])  # NaNs, bf16 ties, fp8 ties and range
    fused[0, q_width + 3:q_width + 3 + len(special)] = special  # into k
    fused[1, 2 * q_width + HEAD_DIM:2 * q_width + HEAD_DIM + len(special)] = special  # into v's second head
    k, v = fused[:, q_width:].split(q_width, dim=1)
    return k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_kernel_writes_the_bits_torch_assigns(dtype):
    k, v = _rows(9, seed=1)
    assert k.stride(0) == 3 * KV_HEADS * HEAD_DIM  # read in place, not copied first
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:9]
    blocks, offsets = (slots // BLOCK_SIZE).to(torch.int32), slots % BLOCK_SIZE
    assert k.isnan().sum() == 2 and v.isnan().sum() == 2
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


def test_the_engines_steps_write_their_keys_and_values_by_the_kernel(tmp_path, monkeypatch):
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.engine.kv.kv_cache import KVCache
    from tests.support.checkpoints import tiny_llama_config, write_checkpoint

    engine = Engine(EngineConfig(model=str(write_checkpoint(tiny_llama_config(), tmp_path)), num_blocks=16,
                                 block_size=4, attention_backend="cpu"), load_tokenizer=False)
    engine.model.fuse_layers = False  # the eager layers, whose attention writes through the backend
    expected = engine.generate([[5, 9, 13, 200, 7, 7]], {"max_tokens": 4, "temperature": 0.0})[0].token_ids

    def refuse(*args):
        raise AssertionError("the keys and values took torch's indexed assignment")

    monkeypatch.setattr(KVCache, "write", refuse)
    assert engine.generate([[5, 9, 13, 200, 7, 7]], {"max_tokens": 4, "temperature": 0.0})[0].token_ids == expected
