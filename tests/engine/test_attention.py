"""Attention backends: the torch path against a dense reference, the flash-attn backend's paged
metadata against the torch path (a torch stand-in for the CUDA kernel), and which backend
``make_attention`` picks. The Triton kernel itself: tests/engine/test_attention_triton.py."""
import math
import sys
import types

import pytest
import torch

from common.engine.attention.backend_torch import TorchAttention

from common.engine.attention.interface import AttentionRequest

from common.engine.attention.selection import make_attention
from common.engine.attention.backend_flash import FlashAttention
from common.engine.kv.kv_cache import KVCache, KVLayout
from tests.support.attention_reference import (DIM, HEADS, KV_HEADS, kvcache_reference, paged_reference, scenario,
                                               varlen_reference)


@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_matches_dense_attention(window):
    cache, requests, q, k, v = scenario(block_size=4)
    expected = paged_reference(cache, requests, q, k, v, window)
    backend = TorchAttention({window}, 4)
    meta = backend.prepare(requests, "cpu")
    out = backend.forward(q, k, v, cache, 0, meta, window, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


DECODES = [(1, 600), (1, 257), (1, 1), (1, 40)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dim", [DIM, 48, 256])
def test_cpu_kernel_reads_the_cache_in_place_and_matches_dense_attention(cpu_kernel, window, block_size, dim):
    from common.engine.attention.backend_cpu import CpuPagedAttention

    # prompt chunks after a cached prefix, decodes (one far longer than the rest), a fresh prompt
    specs = [(5, 3 * block_size + 7), (1, 2 * block_size + 1), (9, 9), (1, 40 * block_size + 3), (1, 2)]
    cache, requests, q, k, v = scenario(block_size, num_blocks=128, specs=specs, dim=dim)
    expected = paged_reference(cache, requests, q, k, v, window)
    backend = CpuPagedAttention({window}, block_size, cpu_kernel)
    out = backend.forward(q, k, v, cache, 0, backend.prepare(requests, "cpu"), window, dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the new K/V are in their slots
    for r in requests:
        pos = r.context_len - 1
        torch.testing.assert_close(cache.key(0)[r.block_ids[pos // block_size], pos % block_size],
                                   k[r.query_start + r.num_query_tokens - 1])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 1), (6, 2)])  # groups 1, 4, 8 and 3 (no vector path)
@pytest.mark.parametrize("dim", [16, 48, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_for_each_gqa_group_head_width_and_dtype(cpu_kernel, heads, kv_heads, dim, dtype, monkeypatch):
    """The kernel's vector path (groups 1, 2, 4, 8; any width a multiple of 16, including one that
    leaves a part of a value chunk) and its scalar path agree with the reference, fp32 and bf16; the
    vector path takes the trailing fresh prompt too, the scalar one leaves it to torch's attention."""
    from common.engine.attention import backend_cpu
    from common.engine.attention.backend_cpu import CpuPagedAttention

    dense_calls = []
    dense = backend_cpu.dense_causal_attention
    monkeypatch.setattr(backend_cpu, "dense_causal_attention", lambda *a: dense_calls.append(1) or dense(*a))
    block_size = 16
    specs = [(5, 3 * block_size + 7), (1, 1), (1, 2 * block_size + 1), (1, 40 * block_size + 3), (2, 21), (19, 19)]
    cache, requests, q, k, v = scenario(block_size, num_blocks=128, specs=specs, dim=dim, heads=heads,
                                        kv_heads=kv_heads)
    expected = paged_reference(cache, requests, q, k, v, None)
    if dtype == torch.bfloat16:  # the reference from the same rounded inputs
        cache.buffer.copy_(cache.buffer.bfloat16().float())
        q, k, v = (t.bfloat16().float() for t in (q, k, v))
        expected = paged_reference(cache, requests, q, k, v, None)
        rounded = KVCache(KVLayout("m", "bfloat16", block_size, 1, kv_heads, dim), cache.num_blocks)
        rounded.buffer.copy_(cache.buffer)
        cache, q, k, v = rounded, q.bfloat16(), k.bfloat16(), v.bfloat16()
    backend = CpuPagedAttention({None}, block_size, cpu_kernel)
    meta = backend.prepare(requests, "cpu")
    assert meta.kernel_requests == len(requests) - 1  # all but the trailing fresh prompt, without a vector path
    out = backend.forward(q, k, v, cache, 0, meta, None, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounded to bf16
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    assert len(dense_calls) == (0 if heads // kv_heads in (1, 2, 4, 8) else 1)


@pytest.mark.parametrize("window", [None, 5, 64])
def test_cpu_backend_computes_trailing_fresh_prompts_densely_and_exactly(cpu_kernel, window):
    """The fresh prompts after the step's decodes and continued chunks take the fused dense path
    (a window shorter than a prompt as a mask), the rest the kernel; every output as the reference."""
    from common.engine.attention.backend_cpu import CpuPagedAttention

    block_size = 4
    specs = [(5, 3 * block_size + 7), (1, 2 * block_size + 1), (12, 12), (1, 1), (9, 9)]
    cache, requests, q, k, v = scenario(block_size, num_blocks=128, specs=specs)
    expected = paged_reference(cache, requests, q, k, v, window)
    backend = CpuPagedAttention({window}, block_size, cpu_kernel)
    meta = backend.prepare(requests, "cpu")
    assert meta.kernel_requests == 2 and meta.dense == [(6, 12), (18, 1), (19, 9)]
    out = backend.forward(q, k, v, cache, 0, meta, window, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for r in requests:  # the dense prompts' K/V are in their slots too
        for j in range(r.num_query_tokens):
            pos = r.context_len - r.num_query_tokens + j
            torch.testing.assert_close(cache.value(0)[r.block_ids[pos // block_size], pos % block_size],
                                       v[r.query_start + j])
    only_prompts = [AttentionRequest(0, 12, 12, requests[2].block_ids), AttentionRequest(12, 9, 9, requests[4].block_ids)]
    assert backend.prepare(only_prompts, "cpu").kernel_requests == 0


def test_cpu_kernel_in_bf16_is_close_to_fp32(cpu_kernel):
    from common.engine.attention.backend_cpu import CpuPagedAttention

    cache, requests, q, k, v = scenario(16, num_blocks=64)
    expected = paged_reference(cache, requests, q, k, v, None)
    bf16 = KVCache(KVLayout("m", "bfloat16", 16, 1, KV_HEADS, DIM), cache.num_blocks)
    bf16.buffer.copy_(cache.buffer)
    backend = CpuPagedAttention({None}, 16, cpu_kernel)
    out = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), bf16, 0, backend.prepare(requests, "cpu"), None,
                          DIM**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("block_size", [256, 512])  # flash-attn 2 pages only in multiples of 256
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("specs", [None, DECODES], ids=["mixed_varlen", "decodes_kvcache"])
def test_flash_backend_metadata_matches_torch_backend(block_size, window, specs):
    """Mixed steps go through flash_attn_varlen_func, decode-only steps through
    flash_attn_with_kvcache; both read the cache itself through the block table."""
    cache, requests, q, k, v = scenario(block_size, num_blocks=16, specs=specs)
    torch_cache = KVCache(cache.layout, cache.num_blocks)
    torch_cache.buffer.copy_(cache.buffer)
    expected_backend = TorchAttention({window}, block_size)
    expected = expected_backend.forward(q, k, v, torch_cache, 0, expected_backend.prepare(requests, "cpu"), window,
                                        DIM**-0.5)
    calls = []

    def varlen(*args, **kwargs):
        calls.append(("varlen", args[1], kwargs))
        return varlen_reference(*args, **kwargs)

    def with_kvcache(*args, **kwargs):
        calls.append(("kvcache", args[1], kwargs))
        return kvcache_reference(*args, **kwargs)

    flash = FlashAttention({window}, block_size, varlen_func=varlen, kvcache_func=with_kvcache)
    out = flash.forward(q, k, v, cache, 0, flash.prepare(requests, "cpu"), window, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.buffer, torch_cache.buffer)  # both wrote the same slots
    [(kind, key_cache, kwargs)] = calls
    assert kind == ("kvcache" if specs == DECODES else "varlen")
    assert key_cache.data_ptr() == cache.key(0).data_ptr()  # the cache itself, read through the table
    assert kwargs["block_table"].dtype == torch.int32


def test_flash_refuses_block_sizes_it_cannot_page():
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttention({None}, 16, varlen_func=varlen_reference, kvcache_func=kvcache_reference)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """Pretend flash-attn is installed (its varlen function is the torch stand-in above)."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = varlen_reference
    module.flash_attn_with_kvcache = kvcache_reference
    monkeypatch.setitem(sys.modules, "flash_attn", module)


@pytest.mark.parametrize("block_size, expected", [(16, "triton"), (24, "triton"), (256, "flash"), (512, "flash")])
def test_auto_backend_on_cuda_is_flash_where_it_pages_else_triton(fake_flash_attn, block_size, expected):
    backend = make_attention("auto", torch.device("cuda"), {None}, block_size)
    assert backend.name == expected


def test_auto_backend_on_cuda_without_flash_attn_is_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert make_attention("auto", torch.device("cuda"), {None}, 256).name == "triton"
    from common.engine.attention import backend_cpu

    cpu_auto = "cpu" if backend_cpu.build_kernel() is not None else "torch"
    assert make_attention("auto", torch.device("cpu"), {None}, 256).name == cpu_auto
    assert make_attention("auto", torch.device("cpu"), {None}, 256, torch.float16).name == "torch"


def test_explicit_backends_that_cannot_run_say_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton"):
        make_attention("triton", torch.device("cpu"), {None}, 16)
    with pytest.raises(ValueError, match="CUDA"):
        make_attention("flash", torch.device("cpu"), {None}, 256)


def test_decodes_of_very_different_lengths_are_bucketed_and_still_exact():
    g = torch.Generator().manual_seed(3)
    bs = 4
    layout = KVLayout("m", "float32", bs, 1, KV_HEADS, DIM)
    cache = KVCache(layout, 200)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g))
    perm = torch.randperm(200, generator=g).tolist()
    requests = [AttentionRequest(i, 1, ctx, [perm.pop() for _ in range(math.ceil(ctx / bs))])
                for i, ctx in enumerate([3, 700, 6, 9])]
    q = torch.randn(4, HEADS, DIM, generator=g)
    k = torch.randn(4, KV_HEADS, DIM, generator=g)
    v = torch.randn(4, KV_HEADS, DIM, generator=g)
    expected = paged_reference(cache, requests, q, k, v, None)
    backend = TorchAttention({None}, bs)
    meta = backend.prepare(requests, "cpu")
    assert [len(index) for index, _table, _masks in meta.extra["decodes"]] == [3, 1]  # short ones apart from the long
    out = backend.forward(q, k, v, cache, 0, meta, None, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
