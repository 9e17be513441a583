"""The CPU kernel's prompt tiles (``csrc/paged_attention_tiles.h``): chunks of many new tokens
attended a tile of query rows at a time, against the dense reference and the per-token path."""
from __future__ import annotations

import ctypes

import pytest
import torch

from common.engine.attention.backend_cpu import CpuPagedAttention
from common.engine.kv.kv_cache import KVCache, KVLayout
from tests.support.attention_reference import paged_reference, scenario


@pytest.fixture
def tiles(cpu_kernel):
    """``set(allow)`` turns the tiles on or off in this process (on again afterwards);
    ``min_tokens`` / ``min_keys``: the new tokens and the keys a chunk needs to take them."""
    fn = cpu_kernel.paged_attention_tiles
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    keys = ctypes.c_int()

    class Tiles:
        min_tokens = fn(1, ctypes.byref(keys))
        min_keys = keys.value

        @staticmethod
        def set(allow: bool) -> None:
            fn(int(allow), ctypes.byref(keys))

        @classmethod
        def takes(cls, request, window) -> bool:
            first = request.context_len - request.num_query_tokens
            keys_seen = request.context_len - (max(0, first - window + 1) if window else 0)
            return request.num_query_tokens >= cls.min_tokens and keys_seen >= cls.min_keys

    yield Tiles
    fn(1, ctypes.byref(keys))


def _attend(kernel, cache, requests, q, k, v, window, dim):
    backend = CpuPagedAttention({window}, cache.layout.block_size, kernel)
    return backend.forward(q, k, v, cache, 0, backend.prepare(requests, "cpu"), window, dim**-0.5)


def _to_bf16(cache, q, k, v):
    """Everything rounded to bf16 (the cache in a bf16 cache), and the reference from the same values."""
    rounded = KVCache(KVLayout("m", "bfloat16", cache.layout.block_size, 1, cache.layout.num_kv_heads,
                               cache.layout.head_dim), cache.num_blocks)
    rounded.buffer.copy_(cache.buffer.bfloat16())
    cache.buffer.copy_(cache.buffer.bfloat16().float())
    return rounded, *(t.bfloat16() for t in (q, k, v))


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (8, 1)])  # groups 1, 2, 4, 8
@pytest.mark.parametrize("dim", [16, 48, 256])  # one vector; a register tile's part; several tiles of dims
def test_prompt_chunks_in_tiles_match_the_reference(cpu_kernel, tiles, window, heads, kv_heads, dim):
    """Chunks for the tiles -- fresh, after a cached prefix, one token past a tile's rows, longer
    than the register tiles' keys -- beside decodes and chunks too short for them (too few new
    tokens; too few keys)."""
    n, keys = tiles.min_tokens, tiles.min_keys
    block_size = 16
    specs = [(keys, keys), (1, 70), (n + 7, 3 * block_size + keys + 7), (3, 40), (5 * n + 1, 5 * n + keys + 1),
             (n + 1, 200 + n + 1), (n, n)]
    cache, requests, q, k, v = scenario(block_size, num_blocks=256, specs=specs, dim=dim, heads=heads,
                                        kv_heads=kv_heads)
    expected = paged_reference(cache, requests, q, k, v, window)
    out = _attend(cpu_kernel, cache, requests, q, k, v, window, dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    tiles.set(False)
    per_token = _attend(cpu_kernel, cache, requests, q, k, v, window, dim)
    torch.testing.assert_close(per_token, expected, rtol=1e-5, atol=1e-5)
    # the two paths sum in different orders: some output differs in its last bits (the tiles ran)
    assert not torch.equal(out, per_token)
    assert sum(tiles.takes(r, window) for r in requests) >= 2
    other_rows = torch.cat([torch.arange(r.query_start, r.query_start + r.num_query_tokens)
                            for r in requests if not tiles.takes(r, window)])
    assert torch.equal(out[other_rows], per_token[other_rows])  # the other requests' path is unchanged


@pytest.mark.parametrize("q_bf16", [False, True])
def test_bf16_cache_and_queries_in_tiles(cpu_kernel, tiles, q_bf16):
    n, keys = tiles.min_tokens, tiles.min_keys
    specs = [(n + keys + 3, n + keys + 3), (n, 90 + keys), (1, 33)]
    cache, requests, q, k, v = scenario(16, num_blocks=128, specs=specs, dim=256, heads=4, kv_heads=1)
    rounded, q16, k16, v16 = _to_bf16(cache, q, k, v)
    expected = paged_reference(cache, requests, q16.float(), k16.float(), v16.float(), None)
    out = _attend(cpu_kernel, rounded, requests, q16 if q_bf16 else q16.float(), k16, v16, None, 256)
    tolerance = 1e-2 if q_bf16 else 1e-5  # bf16 queries: the output rounded to bf16
    assert out.dtype == (torch.bfloat16 if q_bf16 else torch.float32)
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_a_chunk_over_the_tiles_key_limit_stays_per_token_and_exact(cpu_kernel, tiles):
    """A window keeps a long context's chunk within the tiles' keys; without one it is per token."""
    n = tiles.min_tokens
    specs = [(n, 17000)]  # over TILE_MAX_KEYS (16384)
    cache, requests, q, k, v = scenario(64, num_blocks=280, specs=specs, dim=16, heads=2, kv_heads=1)
    for window in (None, 100):
        expected = paged_reference(cache, requests, q, k, v, window)
        torch.testing.assert_close(_attend(cpu_kernel, cache, requests, q, k, v, window, 16), expected,
                                   rtol=1e-5, atol=1e-5)
