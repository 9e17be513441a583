"""``--kv-cache-dtype fp8``: a KV cache of float8 e4m3 values (no scale, as vLLM's fp8 cache without
calibrated scales), a quarter of an fp32 cache's bytes.

The C side rounds into it as torch's float32 -> float8_e4m3fn conversion does and reads it as torch's
widening does, bit for bit (every bf16 bit pattern, the ties, the saturation, the subnormals); the
CPU attention kernel over an fp8 cache computes what it computes over an fp32 cache holding the same
values, bit for bit but where an output underflows fp32's normal range (its vector path, which reads
the rows scaled by 1/256 and takes the factor back in its scale and sums; its scalar path; the tiles
of prompt chunks; the AVX2 build); the torch backend agrees with it; the backends that cannot read
the cache say so; an engine, speculation and the worker flag take it.  (The fused layers' stores and attention over
it: ``test_fused_layers.py``; its blocks on the wire: ``tests/kvtransfer/test_kv_transfer_suite.py``;
its quality: ``benchmarks/quant_quality.py --kv-fp8``.)"""
from __future__ import annotations

import ctypes

import pytest
import torch

from common.engine.attention.interface import AttentionRequest
from common.engine.attention.selection import make_attention
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.kv.kv_cache import KVCache, KVLayout
from tests.support.attention_reference import paged_reference, scenario
from tests.support.checkpoints import tiny_gemma3_config, write_checkpoint

pytestmark = pytest.mark.slow(seconds=12)  # a long file: scheduled by its length (tests/conftest.py)

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def codec():
    from common.engine.cpu_kernels import load_kernel

    lib = load_kernel("fp8_e4m3_cpu")
    if lib is None:
        pytest.skip("no C compiler")
    for name in ("fp8_e4m3_encode", "fp8_e4m3_decode"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        getattr(lib, name).restype = None
    return lib


def c_encode(codec, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous().float()
    out = torch.empty(x.shape, dtype=torch.uint8)
    codec.fp8_e4m3_encode(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def test_the_c_rounding_is_torchs_bit_for_bit(codec):
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    finite = codes[torch.isfinite(codes)].unique()
    ties = (finite[1:] + finite[:-1]) / 2  # halfway between neighbours: to the even code
    near = torch.cat([ties.nextafter(ties + 1), ties.nextafter(ties - 1)])
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e30, float("inf"), 2.0**-6, 2.0**-9, 2.0**-10,
                          3 * 2.0**-11, 1e-40, 0.0, float("nan")])
    x = torch.cat([every_bf16, ties, -ties, near, -near, edges, -edges,
                   torch.randn(100_000, generator=g) * 10.0 ** torch.randint(-4, 3, (100_000,), generator=g)])
    assert torch.equal(c_encode(codec, x), x.to(FP8).view(torch.uint8))


def test_the_c_widening_is_torchs_for_every_code(codec):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    codec.fp8_e4m3_decode(codes.data_ptr(), out.data_ptr(), 256)
    expected = codes.view(FP8).float()
    assert torch.equal(out.isnan(), expected.isnan()) and int(expected.isnan().sum()) == 2
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


def fp8_and_fp32_caches(heads, kv_heads, dim, specs, block_size=16, every_code=False):
    """``scenario``'s step over an fp8 cache (its random values rounded; ``every_code``: random finite
    codes instead, every exponent and the subnormals, values up to 448), and over an fp32 cache holding
    the fp8 one's values (the new keys and values rounded as the fp8 cache will hold them)."""
    cache, requests, q, k, v = scenario(block_size, num_blocks=128, specs=specs, dim=dim, heads=heads,
                                        kv_heads=kv_heads)
    fp8 = KVCache(KVLayout("m", "fp8", block_size, 1, kv_heads, dim), cache.num_blocks)
    if every_code:
        codes = torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        fp8.buffer.view(torch.uint8).copy_(torch.where((codes & 0x7F) == 0x7F, codes - 1, codes))  # no NaN
    else:
        fp8.buffer.copy_(cache.buffer.to(FP8))
    cache.buffer.copy_(fp8.buffer.float())
    k_rounded, v_rounded = k.to(FP8).float(), v.to(FP8).float()
    return fp8, cache, requests, q, (k, v), (k_rounded, v_rounded)


def assert_same_values(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit, but where the output itself is far below fp32's normal range: there the vector
    path's products at 1/256 (values up to 448 with softmax weights down to e^-87) fall below it and
    round apart in their last bits (~1e-40)."""
    tiny = expected.abs() < 2.0**-100
    assert torch.equal(out[~tiny], expected[~tiny])
    torch.testing.assert_close(out[tiny], expected[tiny], rtol=0, atol=2.0**-100)


# a prompt chunk after a prefix, decodes (one long), a chunk long enough for the tiles, a fresh prompt
SPECS = [(5, 55), (1, 1), (1, 33), (1, 643), (40, 200), (19, 19)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (8, 1), (6, 2)])  # group 3: no vector path
@pytest.mark.parametrize("dim", [16, 48, 256])
@pytest.mark.parametrize("every_code", [False, True])
def test_the_cpu_kernel_over_fp8_computes_what_it_computes_over_those_values_in_fp32(cpu_kernel, heads, kv_heads,
                                                                                      dim, every_code):
    from common.engine.attention.backend_cpu import CpuPagedAttention

    fp8, fp32, requests, q, new, new_rounded = fp8_and_fp32_caches(heads, kv_heads, dim, SPECS, every_code=every_code)
    backend = CpuPagedAttention({None}, 16, cpu_kernel)
    meta = backend.prepare(requests, "cpu")
    out = backend.forward(q, *new, fp8, 0, meta, None, dim**-0.5)
    expected = backend.forward(q, *new_rounded, fp32, 0, meta, None, dim**-0.5)
    assert torch.equal(fp8.buffer.float(), fp32.buffer)  # the new keys and values rounded as torch rounds
    assert_same_values(out, expected)
    if not every_code:  # (scores of keys up to 448 make a reference in another order differ more)
        torch.testing.assert_close(out, paged_reference(fp32, requests, q, *new_rounded, None), rtol=1e-5, atol=1e-5)


def test_bf16_queries_over_fp8_take_the_same_values_as_over_fp32(cpu_kernel):
    """A bf16 model over an fp8 cache: its own vector path (bf16 queries and outputs)."""
    from common.engine.attention.backend_cpu import CpuPagedAttention

    fp8, fp32, requests, q, new, new_rounded = fp8_and_fp32_caches(4, 1, 256, SPECS)
    q, new = q.bfloat16(), tuple(t.bfloat16() for t in new)
    new_rounded = tuple(t.to(FP8).bfloat16() for t in new)  # exact: every fp8 value is a bf16 one
    backend = CpuPagedAttention({None}, 16, cpu_kernel)
    meta = backend.prepare(requests, "cpu")
    out = backend.forward(q, *new, fp8, 0, meta, None, 256**-0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, backend.forward(q, *new_rounded, fp32, 0, meta, None, 256**-0.5))
    reference = paged_reference(fp32, requests, q.float(), *(t.float() for t in new_rounded), None)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


def every_code_through_the_vector_path(kernel):
    """A decode whose one key's value row holds every code, NaNs too: its output is that row as torch
    widens it (its weight is 1)."""
    from common.engine.attention.backend_cpu import CpuPagedAttention

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    row = codes.view(FP8).float()
    cache = KVCache(KVLayout("m", "fp8", 16, 1, 1, 256), 2)
    backend = CpuPagedAttention({None}, 16, kernel)
    meta = backend.prepare([AttentionRequest(0, 1, 1, [1])], "cpu")
    assert backend.vector_path(4, 1, 4, 256)
    q = torch.randn(1, 4, 256)
    out = backend.forward(q, torch.randn(1, 1, 256), row.view(1, 1, 256), cache, 0, meta, None, 256**-0.5)
    assert torch.equal(cache.value(0)[1, 0, 0].view(torch.uint8)[row.isfinite()], codes[row.isfinite()])
    for head in out[0]:
        assert torch.equal(head.isnan(), row.isnan()) and int(row.isnan().sum()) == 2
        assert torch.equal(head[row.isfinite()], row[row.isfinite()])


def test_the_vector_path_widens_every_code_as_torch_does(cpu_kernel):
    every_code_through_the_vector_path(cpu_kernel)


def test_the_kernels_avx2_build_over_fp8_computes_what_it_computes_over_fp32(tmp_path):
    """The 8-lane vector path (``-march=haswell``: AVX2, FMA, F16C) that AVX2 CPUs take, wherever it runs."""
    from common.engine import cpu_kernels
    from common.engine.attention.backend_cpu import CpuPagedAttention, declared
    from tests.support.cpu_flags import cpu_has

    if not cpu_has("avx2", "fma", "f16c"):
        pytest.skip("no AVX2, FMA and F16C on this CPU")
    target = tmp_path / "paged_attention_cpu.so"
    try:
        cpu_kernels.compile_source(cpu_kernels.SOURCES / "paged_attention_cpu.c", target, march="haswell")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    lib = declared(ctypes.CDLL(str(target)))
    every_code_through_the_vector_path(lib)
    backend = CpuPagedAttention({None}, 16, lib)
    for every_code in (False, True):
        fp8, fp32, requests, q, new, new_rounded = fp8_and_fp32_caches(4, 1, 256, SPECS, every_code=every_code)
        meta = backend.prepare(requests, "cpu")
        out = backend.forward(q, *new, fp8, 0, meta, None, 256**-0.5)
        assert_same_values(out, backend.forward(q, *new_rounded, fp32, 0, meta, None, 256**-0.5))


def test_the_torch_backend_reads_an_fp8_cache_as_the_kernel_does(cpu_kernel):
    from common.engine.attention.backend_cpu import CpuPagedAttention

    fp8, _, requests, q, new, _ = fp8_and_fp32_caches(4, 1, 256, SPECS)
    fp8_again = KVCache(fp8.layout, fp8.num_blocks)
    fp8_again.buffer.copy_(fp8.buffer)
    kernel = CpuPagedAttention({None}, 16, cpu_kernel)
    out = kernel.forward(q, *new, fp8, 0, kernel.prepare(requests, "cpu"), None, 256**-0.5)
    torch_backend = make_attention("torch", torch.device("cpu"), {None}, 16, torch.float32, FP8)
    expected = torch_backend.forward(q, *new, fp8_again, 0, torch_backend.prepare(requests, "cpu"), None, 256**-0.5)
    assert torch.equal(fp8.buffer.view(torch.uint8), fp8_again.buffer.view(torch.uint8))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_backends_that_cannot_read_fp8_say_so_or_are_not_chosen(monkeypatch):
    with pytest.raises(ValueError, match="fp8"):
        make_attention("triton", torch.device("cuda"), {None}, 16, torch.bfloat16, FP8)
    with pytest.raises(ValueError, match="model's dtype"):
        make_attention("flash", torch.device("cuda"), {None}, 256, torch.bfloat16, FP8)
    assert make_attention("auto", torch.device("cuda"), {None}, 256, torch.bfloat16, FP8).name == "torch"


def test_an_engine_serves_over_an_fp8_cache_of_a_quarter_of_the_bytes(tmp_path):
    """The prompt scores near those over an fp32 cache (its keys and values rounded, not garbled), and a
    prefix-cache hit reads the cached fp8 blocks as they were written."""
    checkpoint = write_checkpoint(tiny_gemma3_config(), tmp_path)
    engines = {kv: Engine(EngineConfig(model=str(checkpoint), kv_cache_dtype=kv, num_blocks=32, block_size=4),
                          load_tokenizer=False) for kv in ("auto", "fp8")}
    assert engines["fp8"].kv_cache.buffer.dtype == FP8 and engines["fp8"].layout.dtype == "fp8"
    assert engines["fp8"].layout.block_nbytes * 4 == engines["auto"].layout.block_nbytes
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 0}
    prompt = [[5, 9, 13, 200, 31, 7, 7, 64, 12, 90, 3, 44, 18, 18, 250, 6, 77]]
    scored = {kv: e.generate(prompt, params)[0] for kv, e in engines.items()}
    logprobs = {kv: torch.tensor([t.logprob for t in r.prompt_logprobs[1:]]) for kv, r in scored.items()}
    difference = (logprobs["fp8"] - logprobs["auto"]).abs()
    assert 0 < difference.max() < 0.05 * logprobs["auto"].abs().mean()
    again = engines["fp8"].generate(prompt, {**params, "prompt_logprobs": None})[0]  # (scoring reads no cache)
    assert again.num_cached_tokens > 0 and again.token_ids == scored["fp8"].token_ids


def test_the_worker_flag_and_its_environment_variable_take_fp8():
    from worker.config import build_parser, config_from_args

    for env, argv in (({}, ["--kv-cache-dtype", "fp8"]), ({"PDSERVE_KV_CACHE_DTYPE": "fp8"}, [])):
        args = build_parser("decode", "test", env=env).parse_args(["--model", "m", *argv])
        assert config_from_args(args).engine.kv_cache_dtype == "fp8"


def test_speculation_over_an_fp8_cache_keeps_greedy_output_and_releases_every_block(tmp_path):
    """Verification writes drafts' keys and values into the fp8 cache and rolls rejected ones back."""
    from tests.support.checkpoints import random_prompts

    checkpoint = write_checkpoint(tiny_gemma3_config(), tmp_path)
    base = random_prompts([6, 19, 33], seed=1)
    prompts = base + [p + p for p in base]  # repeated text: the n-gram lookup finds drafts
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    outputs = {}
    for speculative in ("none", "ngram"):
        engine = Engine(EngineConfig(model=str(checkpoint), kv_cache_dtype="fp8", num_blocks=128, block_size=4,
                                     speculative=speculative, num_speculative_tokens=4, ngram_min=1,
                                     speculative_cost_gate=False), load_tokenizer=False)
        outputs[speculative] = [r.token_ids for r in engine.generate(prompts, params)]
        engine.scheduler.kv_manager.check_integrity()
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert engine.stats()["spec_verifications_total"] > 0
    assert outputs["ngram"] == outputs["none"]
