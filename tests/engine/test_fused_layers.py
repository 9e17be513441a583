"""Every decoder layer of a small eager fp32 step in one C call (``common.engine.models.fused_layers``):
the hidden states and the KV cache equal the eager layers' bit for bit, on tiny random checkpoints of
each family (Llama: silu, no sandwich, GQA 2; Gemma 3: q/k norms, sandwich norms, tanh GELU,
sliding windows; Llama with attention biases), with fp32 weights on panels and int8 / int4 on the
VNNI kernels, over prompts, decodes beside a prompt, several tokens of one request at once and a
prompt past the compiled layers' threshold; and
with a bf16 or fp8 KV cache under the fp32 model (``--kv-cache-dtype``), whose new keys and values the C
side rounds as torch does."""
from __future__ import annotations

import pytest
import torch

from common.engine.attention.interface import AttentionRequest
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.models import int4_vnni, int8_gemv, int8_vnni
from common.engine.models import panels as panel_products
from common.engine.models.fused_layers import MAX_ROWS, FusedLayers
from common.engine.models.stages import MIN_COMPILED_TOKENS
from tests.support.checkpoints import VOCAB, tiny_gemma3_config, tiny_llama_config, write_checkpoint

CONFIGS = {"llama": tiny_llama_config, "gemma3": tiny_gemma3_config,
           "llama-bias": lambda: tiny_llama_config(attention_bias=True)}
BLOCK = 4


def _kernels_for(quantization: str) -> bool:
    if quantization == "int4":  # its kernel builds on AVX2 CPUs too
        return int4_vnni.kernel() is not None
    if quantization == "int8":  # the VNNI kernel, or elsewhere the fp32-sum one
        return int8_vnni.kernel() is not None or int8_gemv.kernel() is not None
    return panel_products.native()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))


def engine_for(directory, quantization="none", dtype="float32", kv_cache_dtype="auto"):
    engine = Engine(EngineConfig(model=str(directory), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                 quantization=quantization,
                                 quantization_group_size=32, num_blocks=32, block_size=BLOCK,
                                 max_num_batched_tokens=256), load_tokenizer=False)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # transformers initializes biases to zero: make them count
        for name, param in engine.model.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(torch.randn(param.shape, generator=g).to(param.dtype))
    return engine


# Steps of (tokens, position of the first, context after the step, blocks) per request: two prompts
# (the second longer than Gemma's window of 8), then both decoding beside a third prompt, then
# three tokens of one request at once (a speculative verification's shape) beside a decode, then a
# prompt of more tokens than the compiled layers' threshold (MIN_COMPILED_TOKENS) beside a decode.
STEPS = [
    [(7, 0, 7, [0, 1]), (11, 0, 11, [2, 3, 4])],
    [(1, 7, 8, [0, 1]), (1, 11, 12, [2, 3, 4]), (5, 0, 5, [5, 6])],
    [(3, 8, 11, [0, 1, 7]), (1, 12, 13, [2, 3, 4, 8])],
    [(70, 0, 70, list(range(9, 27))), (1, 13, 14, [2, 3, 4, 8])],
]


def run_steps(engine) -> list[torch.Tensor]:
    engine.kv_cache.buffer.zero_()
    g = torch.Generator().manual_seed(1)
    hidden = []
    for step in STEPS:
        requests, positions, start = [], [], 0
        for tokens, first, context, blocks in step:
            requests.append(AttentionRequest(start, tokens, context, blocks))
            positions += range(first, first + tokens)
            start += tokens
        meta = engine.attention.prepare(requests, engine.device)
        ids = torch.randint(3, VOCAB, (start,), generator=g)
        hidden.append(engine.model(ids, torch.tensor(positions), engine.kv_cache, meta, engine.attention))
    return hidden


@pytest.mark.parametrize("quantization,kv_cache_dtype", [("none", "auto"), ("int8", "auto"), ("int4", "auto"),
                                                         ("none", "bfloat16"), ("int8", "bfloat16"), ("none", "fp8"),
                                                         ("int4", "fp8")])
def test_fused_layers_equal_the_eager_layers_bit_for_bit(checkpoint, quantization, kv_cache_dtype, monkeypatch):
    if not _kernels_for(quantization):
        pytest.skip("no C kernel this CPU can run for these weights")
    engine = engine_for(checkpoint, quantization, kv_cache_dtype=kv_cache_dtype)
    calls = []
    run = FusedLayers.run
    monkeypatch.setattr(FusedLayers, "run", lambda self, *args: calls.append(1) or run(self, *args))
    fused = run_steps(engine)
    fused_cache = engine.kv_cache.buffer.clone()
    max_rows = engine.model._fused_layers[2].max_rows  # fp32 weights on panels: PANEL_MAX_ROWS
    fitting = sum(sum(tokens for tokens, *_ in step) <= max_rows for step in STEPS)
    assert fitting >= len(STEPS) - (quantization == "none"), max_rows
    assert len(calls) == fitting, "the steps did not take the fused layers"
    engine.model.fuse_layers = False
    eager = run_steps(engine)
    assert len(calls) == fitting
    for a, b in zip(fused, eager):
        assert torch.equal(a, b)
    assert torch.equal(fused_cache, engine.kv_cache.buffer)
    assert fused_cache.float().abs().sum() > 0


def test_greedy_generation_is_the_same_with_and_without_them(checkpoint):
    if not _kernels_for("int8"):
        pytest.skip("no int8 C kernel on this CPU")
    engine = engine_for(checkpoint, "int8")
    prompts = [[5, 9, 13, 200], list(range(3, 40)), [7] * 12]
    params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    fused = [r.token_ids for r in engine.generate(prompts, params)]
    assert engine.model._fused_layers[2] is not None
    engine.model.fuse_layers = False
    assert [r.token_ids for r in engine.generate(prompts, params)] == fused


def test_steps_and_models_they_do_not_fit_take_the_eager_layers(checkpoint):
    engine = engine_for(checkpoint, "int8" if _kernels_for("int8") else "none")
    fused = FusedLayers.build(engine.model, engine.kv_cache, engine.attention)
    if fused is None:
        pytest.skip("no C kernel this CPU can run for these weights")
    meta = engine.attention.prepare([AttentionRequest(0, 1, 1, [0])], engine.device)
    hidden = engine.model.cfg.hidden_size
    assert fused.applies(torch.zeros(1, hidden), meta)
    if int8_vnni.kernel() is not None:  # int8 on the VNNI kernels: up to MAX_ROWS, past the compiled threshold
        assert fused.max_rows == MAX_ROWS > MIN_COMPILED_TOKENS
        assert fused.applies(torch.zeros(MAX_ROWS, hidden), meta)
    assert not fused.applies(torch.zeros(fused.max_rows + 1, hidden), meta)  # a prefill chunk: compiled/eager
    assert not fused.applies(torch.zeros(1, hidden, dtype=torch.bfloat16), meta)
    bf16 = engine_for(checkpoint, dtype="bfloat16")  # a bf16 model and KV cache
    assert FusedLayers.build(bf16.model, bf16.kv_cache, bf16.attention) is None


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(checkpoint):
    engine = engine_for(checkpoint, "int8" if _kernels_for("int8") else "none")
    fused = FusedLayers.build(engine.model, engine.kv_cache, engine.attention)
    if fused is None:
        pytest.skip("no C kernel this CPU can run for these weights")
    engine.kv_cache.buffer.zero_()
    blocks = engine.kv_cache.buffer.shape[0]
    meta = engine.attention.prepare([AttentionRequest(0, 2, 2, [blocks])], engine.device)  # a block past the cache
    hidden = engine.model.cfg.hidden_size
    cos_sin = {t: engine.model.rotary.cos_sin(torch.tensor([0, 1]), t, torch.float32) for t in fused.rope_types}
    with pytest.raises(IndexError, match="outside the cache"):
        fused.run(torch.randn(2, hidden), cos_sin, meta)
    assert not engine.kv_cache.buffer.any()
