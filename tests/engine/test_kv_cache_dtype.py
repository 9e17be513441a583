"""A KV cache in another dtype than the model's (``--kv-cache-dtype``): every attention path reads
what the cache holds (the new keys and values rounded to its dtype) and computes in the queries'
dtype; an engine's layout, pool and fused layers follow the setting; the wrong combinations are
refused by name."""
from __future__ import annotations

import math

import pytest
import torch

from common.engine.attention.backend_torch import TorchAttention
from common.engine.attention.interface import AttentionRequest
from common.engine.attention.selection import make_attention
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.kv.kv_cache import KVCache, KVLayout
from tests.support.attention_reference import kvcache_reference, paged_reference, varlen_reference
from tests.support.checkpoints import tiny_gemma3_config, write_checkpoint

BLOCK = 16
# (new tokens, context after the step): a chunk after a cached prefix, decodes (one long), a fresh prompt
SPECS = [(5, 3 * BLOCK + 7), (1, 2 * BLOCK + 1), (1, 20 * BLOCK + 3), (2, 21), (9, 9)]


def scenario(cache_dtype: torch.dtype, query_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(KVLayout("m", str(cache_dtype).removeprefix("torch."), BLOCK, 1, kv_heads, dim), 128)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g))
    perm = torch.randperm(128, generator=g).tolist()
    requests, start = [], 0
    for n, context in SPECS:
        requests.append(AttentionRequest(start, n, context, [perm.pop() for _ in range(math.ceil(context / BLOCK))]))
        start += n
    q, k, v = (torch.randn(start, h, dim, generator=g).to(query_dtype) for h in (heads, kv_heads, kv_heads))
    return cache, requests, q, k, v


def check(backend, cache_dtype, query_dtype, heads=4, kv_heads=1, dim=32, window=None):
    cache, requests, q, k, v = scenario(cache_dtype, query_dtype, heads, kv_heads, dim)
    expected = paged_reference(cache, requests, q, k, v, window)
    out = backend.forward(q, k, v, cache, 0, backend.prepare(requests, "cpu"), window, dim**-0.5)
    assert out.dtype == query_dtype
    # fp32 queries: fp32 arithmetic on what the cache holds; bf16 queries: the output rounded to bf16
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    for r in requests:  # the new keys and values in their slots, rounded to the cache's dtype
        for j in range(r.num_query_tokens):
            pos = r.context_len - r.num_query_tokens + j
            slot = (r.block_ids[pos // BLOCK], pos % BLOCK)
            assert torch.equal(cache.key(0)[slot], k[r.query_start + j].to(cache_dtype))
            assert torch.equal(cache.value(0)[slot], v[r.query_start + j].to(cache_dtype))


MIXED = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]  # (cache, queries)


@pytest.mark.parametrize("cache_dtype,query_dtype", MIXED, ids=["bf16-cache", "fp32-cache"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 256), (8, 1, 32), (2, 2, 48), (6, 2, 32)],
                         ids=["group4", "group8", "group1", "group3-scalar"])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_kernel_reads_a_cache_in_another_dtype(cpu_kernel, cache_dtype, query_dtype, heads, kv_heads, dim, window):
    """The vector paths (groups 1, 4, 8) and the scalar one (group 3, whose fresh prompt goes to
    torch's dense attention over its rounded keys) against fp32 attention over the cache's values."""
    from common.engine.attention.backend_cpu import CpuPagedAttention

    check(CpuPagedAttention({window}, BLOCK, cpu_kernel), cache_dtype, query_dtype, heads, kv_heads, dim, window)


@pytest.mark.parametrize("cache_dtype,query_dtype", MIXED, ids=["bf16-cache", "fp32-cache"])
def test_torch_backend_reads_a_cache_in_another_dtype(cache_dtype, query_dtype):
    check(TorchAttention({5}, BLOCK), cache_dtype, query_dtype, window=5)


def test_the_cache_write_rounds_to_nearest_even_and_keeps_nan():
    cache = KVCache(KVLayout("m", "bfloat16", 4, 1, 1, 4), 2)
    k = torch.tensor([[[1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-9), float("nan")]]])  # ties to even, below half
    cache.write(0, torch.tensor([1]), torch.tensor([2]), k, k * 2)
    assert cache.key(0)[1, 2, 0, :3].tolist() == [1.0, 1.0 + 2**-6, -1.0]
    assert math.isnan(cache.key(0)[1, 2, 0, 3].item()) and cache.value(0)[1, 2, 0, 0].item() == 2.0


def test_backends_that_cannot_read_another_dtype_are_refused_or_passed_over(monkeypatch):
    import sys
    import types

    flash_attn = types.ModuleType("flash_attn")  # installed, as far as the selection can tell
    flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache = varlen_reference, kvcache_reference
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    cuda = torch.device("cuda")
    assert make_attention("auto", cuda, {None}, 256, torch.bfloat16).name == "flash"
    assert make_attention("auto", cuda, {None}, 256, torch.bfloat16, torch.float16).name == "triton"
    with pytest.raises(ValueError, match="flash.*model's dtype.*kv_cache_dtype"):
        make_attention("flash", cuda, {None}, 256, torch.bfloat16, torch.float16)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cpu.*float16 cache"):
        make_attention("cpu", cpu, {None}, 16, torch.float32, torch.float16)
    assert make_attention("auto", cpu, {None}, 16, torch.float32, torch.float16).name == "torch"


def test_the_setting_is_validated_and_read_from_the_worker_flag():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, fp8.*'fp8_e5m2'"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")
    from worker.config import build_parser, config_from_args

    parser = build_parser("decode", "pdserve worker", env={})
    assert config_from_args(parser.parse_args(["--model", "m"])).engine.kv_cache_dtype == "auto"
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "bfloat16"])
    assert config_from_args(args).engine.kv_cache_dtype == "bfloat16"
    from_env = build_parser("decode", "pdserve worker", env={"PDSERVE_KV_CACHE_DTYPE": "bfloat16"})
    assert config_from_args(from_env.parse_args(["--model", "m"])).engine.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "int3"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tiny_gemma3_config(), tmp_path_factory.mktemp("gemma3"))


def engine_for(checkpoint, kv_cache_dtype: str, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=4,
                    max_num_batched_tokens=256)
    settings.update(overrides)
    return Engine(EngineConfig(**settings), load_tokenizer=False)


def test_an_engine_with_a_bf16_cache_holds_twice_the_tokens_and_stays_close(checkpoint, monkeypatch):
    from common.engine.kv import kv_cache

    monkeypatch.setattr(kv_cache, "_host_memory_available", lambda: 1 << 30)  # the same memory for both
    full, half = (engine_for(checkpoint, d, kv_memory_fraction=0.01) for d in ("auto", "bfloat16"))
    assert (full.layout.dtype, half.layout.dtype) == ("float32", "bfloat16")
    assert half.layout.block_nbytes * 2 == full.layout.block_nbytes
    assert half.kv_cache.buffer.dtype == torch.bfloat16 and half.dtype == torch.float32
    assert half.block_pool.num_blocks in (2 * full.block_pool.num_blocks, 2 * full.block_pool.num_blocks + 1)
    assert half.layout.mismatches(full.layout) == ["dtype: 'bfloat16' != 'float32'"]  # PD peers must agree
    prompt = list(range(3, 40))
    logits = []
    for engine in (full, half):
        engine.generate([prompt], {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        logits.append(engine.model.logits(engine.model(torch.tensor(prompt[:9]), torch.arange(9), engine.kv_cache,
                                                       engine.attention.prepare([AttentionRequest(0, 9, 9, [0, 1, 2])],
                                                                                "cpu"), engine.attention)))
    torch.testing.assert_close(logits[1], logits[0], rtol=0.02, atol=0.02)  # bf16 keys and values: close
    assert not torch.equal(logits[1], logits[0])  # ... but not the fp32 cache's

