"""The CPU KV cache's memory: zeroed, contiguous, and aligned for transparent huge pages."""
from __future__ import annotations

import torch

from common.engine.kv.host_memory import HUGE_PAGE_BYTES, huge_page_zeros
from common.engine.kv.kv_cache import KVCache, KVLayout


def test_large_regions_are_zeroed_and_aligned_to_huge_pages():
    t = huge_page_zeros((5, 3, HUGE_PAGE_BYTES // 4), torch.bfloat16)  # 7.5 huge pages
    assert t.shape == (5, 3, HUGE_PAGE_BYTES // 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()


def test_small_regions_are_plain_zeros():
    t = huge_page_zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()


def test_the_cpu_kv_cache_uses_them():
    layout = KVLayout(model_id="m", dtype="float32", block_size=16, num_layers=4, num_kv_heads=8, head_dim=64)
    cache = KVCache(layout, 64)  # 16 MiB
    assert cache.buffer.data_ptr() % HUGE_PAGE_BYTES == 0 and not cache.buffer.any()
    cache.block(3).fill_(1.0)
    assert cache.buffer[3].all() and not cache.buffer[4].any()
