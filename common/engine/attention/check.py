"""Checks a paged attention backend against the torch path on a set of packed batches.

Used by the tests (Triton under its CPU interpreter, fp32) and by ``benchmarks/gpu_check.py``
(Triton and flash-attn on a GPU, bf16). Each case is one step's packed batch: per request, how
many new tokens it computes and how many keys it has after the step. A case passes when the
backend writes the same cache slots as the torch path and its output is within tolerance of the
torch path's output computed in fp32 from the same (rounded) inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.engine.attention.backend_torch import TorchAttention

from common.engine.attention.interface import AttentionRequest

from common.engine.attention.selection import make_attention
from common.engine.kv.kv_cache import KVCache, KVLayout, dtype_name


@dataclass(frozen=True)
class AttentionCase:
    name: str
    requests: tuple[tuple[int, int], ...]  # per request: (new tokens this step, keys after the step)
    block_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    window: int | None = None


# Small enough for Triton's CPU interpreter on a loaded 2-core machine.
SMALL_CASES = (
    AttentionCase("prefill_chunks", ((7, 7), (12, 45), (70, 90))),  # fresh prompt, chunks after a cached prefix
    AttentionCase("decodes", ((1, 1), (1, 17), (1, 40), (1, 64))),
    AttentionCase("mixed", ((5, 55), (1, 33), (9, 9), (1, 2))),
    AttentionCase("sliding_window", ((20, 50), (1, 33), (3, 3), (1, 9)), window=8),
    AttentionCase("gqa_8_to_1", ((6, 30), (1, 21)), num_heads=8, num_kv_heads=1),
    AttentionCase("gqa_6_to_2", ((6, 30), (1, 21)), num_heads=6, num_kv_heads=2),
    AttentionCase("block_size_256", ((5, 300), (1, 257), (9, 9)), block_size=256),
    AttentionCase("block_size_24_head_dim_24", ((20, 50), (1, 30)), block_size=24, head_dim=24, window=7),
)

# Model-sized heads and contexts, for a GPU.
GPU_CASES = SMALL_CASES + (
    AttentionCase("llama_8b_mixed", ((512, 1500), (1, 3000), (1, 17), (300, 300)), num_heads=32,
                  num_kv_heads=8, head_dim=128),
    AttentionCase("llama_8b_decodes_256", tuple((1, 100 + 37 * i) for i in range(64)), block_size=256,
                  num_heads=32, num_kv_heads=8, head_dim=128),
    AttentionCase("gemma3_sliding_256", ((700, 1200), (1, 900), (64, 64)), block_size=256, num_heads=4,
                  num_kv_heads=1, head_dim=256, window=512),
    AttentionCase("gemma3_sliding_16", ((700, 1200), (1, 900), (64, 64)), num_heads=4, num_kv_heads=1,
                  head_dim=256, window=512),
)


@dataclass
class CaseResult:
    case: str
    backend: str
    max_abs_err: float
    cache_matches: bool


def run_case(case: AttentionCase, backend: str, device: torch.device | str, dtype: torch.dtype,
             seed: int = 0) -> CaseResult:
    """Run one case on ``backend`` and on the torch path (fp32, same device); compare."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    num_blocks = sum(math.ceil(ctx / bs) for _, ctx in case.requests) + 3
    layout = KVLayout("check", dtype_name(dtype), bs, 2, case.num_kv_heads, case.head_dim)
    cache = KVCache(layout, num_blocks, device)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g).to(dtype))
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered block ids
    requests, start = [], 0
    for new, ctx in case.requests:
        requests.append(AttentionRequest(start, new, ctx, [free.pop() for _ in range(math.ceil(ctx / bs))]))
        start += new
    q = torch.randn(start, case.num_heads, case.head_dim, generator=g).to(dtype).to(device)
    k = torch.randn(start, case.num_kv_heads, case.head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(start, case.num_kv_heads, case.head_dim, generator=g).to(dtype).to(device)
    scale = case.head_dim**-0.5
    layer = 1  # the second layer: the block stride skips the first layer's K/V

    reference_cache = KVCache(KVLayout("check", "float32", bs, 2, case.num_kv_heads, case.head_dim), num_blocks,
                              device)
    reference_cache.buffer.copy_(cache.buffer.float())
    reference = TorchAttention({case.window}, bs)
    expected = reference.forward(q.float(), k.float(), v.float(), reference_cache, layer,
                                 reference.prepare(requests, device), case.window, scale)

    candidate = make_attention(backend, device, {case.window}, bs)
    out = candidate.forward(q, k, v, cache, layer, candidate.prepare(requests, device), case.window, scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cache_matches = torch.equal(cache.buffer.float(), reference_cache.buffer)
    return CaseResult(case.name, backend, (out.float() - expected).abs().max().item(), cache_matches)
