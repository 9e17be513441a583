"""A GGUF's 4-bit blocks are kept as the file stores them under ``--quantization int4``
(``common/engine/loading/gguf_blocks.py``): each 4-bit type's groups stand for exactly the weights
gguf-py dequantizes, the int4 kernel computes with them (its bf16 scales the only rounding), fused
products keep them only when every part has them, wider blocks go to int8, and the load says so."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.loading.default_model import converted_gguf_dir
from common.engine.loading.gguf_blocks import BLOCKS_FILE, four_bit_groups
from common.engine.loading.model_loader import load_state_dict
from common.engine.models.quantized import Int4Weight, Int8Weight
from tests.support.gguf_checkpoints import tiny_model, write_gguf

Q = gguf.GGMLQuantizationType


def q4_k_blocks(rows: int, inputs: int, seed: int = 0) -> np.ndarray:
    """Random but well-formed Q4_K blocks (gguf-py cannot quantize to Q4_K): small fp16 d and
    dmin, random 6-bit scales and mins, random nibbles."""
    rng = np.random.default_rng(seed)
    n = rows * inputs // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = rng.uniform(1e-3, 4e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def blocks_of(kind, rows=32, inputs=256):
    if kind == Q.Q4_K:
        return q4_k_blocks(rows, inputs)
    w = np.random.default_rng(1).normal(0, 0.05, (rows, inputs)).astype(np.float32)
    return gguf.quants.quantize(w, kind)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda k: k.name)
def test_each_four_bit_type_is_exactly_groups_of_32_and_the_kernel_computes_with_them(kind):
    rows, inputs = 32, 256
    blocks = blocks_of(kind, rows, inputs)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(rows, inputs).astype(np.float32))
    q, scale, zero = (torch.from_numpy(a) for a in four_bit_groups(blocks, kind, (rows, inputs)))
    assert q.shape == (rows, inputs) and int(q.max()) <= 15 and scale.shape == zero.shape == (rows, inputs // 32)
    groups = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(groups, reference, atol=1e-6, rtol=1e-5)
    kept = Int4Weight.from_groups(q, scale, zero, 32, torch.float32)
    largest = reference.abs().max().item()
    assert (kept.dequantize() - reference).abs().max().item() <= largest * 2 ** -7, "bf16 scales are the only rounding"
    # the product within what rounding the activations costs (int8 groups on VNNI CPUs, bf16 on
    # PyTorch's kernel): ~1% of the output's norm; x fixed (a draw of the global generator made this
    # element-wise bound flaky: one output of 96 near zero past rtol)
    x = torch.randn(3, inputs, generator=torch.Generator().manual_seed(3))
    product, exact = kept.matmul(x), x @ reference.t()
    assert (product - exact).norm() <= 0.02 * exact.norm()
    torch.testing.assert_close(product, exact, atol=0.05 * exact.abs().max().item(), rtol=0)


def quantized_of(engine: Engine, layer: int = 0):
    block = engine.model.model.layers[layer]
    return {"qkv": block.self_attn.qkv_proj.quantized, "o": block.self_attn.o_proj.quantized,
            "gate_up": block.mlp.gate_up_proj.quantized, "down": block.mlp.down_proj.quantized,
            "embed": engine.model.model.embed_tokens.quantized}


def gemma_types(name: str):
    """A Q4_K_M-like mix: 4-bit attention output and MLP input, 4/8-bit attention input, 5-bit down."""
    if "o_proj" in name or "gate_proj" in name or "up_proj" in name:
        return Q.Q4_0
    if "q_proj" in name or "k_proj" in name:
        return Q.Q4_1
    if "down_proj" in name:
        return Q.Q5_0
    return Q.Q8_0  # v_proj, the embedding


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    """The file, converted once for the module (its cache directory travels with it)."""
    directory = tmp_path_factory.mktemp("mixed")
    path = directory / "mixed-gemma3.gguf"
    write_gguf(tiny_model("gemma3"), "gemma3", path, qtype_of=gemma_types)
    converted_gguf_dir(path, cache_dir=directory / "cache", progress=False)
    return path


@pytest.fixture
def cache_of(gemma_gguf, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(gemma_gguf.parent / "cache"))
    return gemma_gguf


def engine_on(path, scheme: str, group: int = 128) -> Engine:
    return Engine(EngineConfig(model=str(path), num_blocks=64, block_size=4, quantization=scheme,
                               quantization_group_size=group), load_tokenizer=False)


def test_int4_keeps_the_files_four_bit_blocks_and_puts_wider_ones_at_int8(cache_of, caplog):
    with caplog.at_level(logging.INFO, logger="common.engine.loading.model_loader"):
        engine = engine_on(cache_of, "int4", group=128)
    converted = engine.checkpoint
    assert (converted / BLOCKS_FILE).is_file()
    # the weights other tools load are the model's alone (vLLM takes every top-level .safetensors)
    assert [f.name for f in converted.glob("*.safetensors")] == ["model.safetensors"]
    state = load_state_dict(converted)  # the fp32 weights the conversion dequantized
    for layer in range(len(engine.model.model.layers)):
        products = quantized_of(engine, layer)
        # kept: 32-input groups as the file has them, though --quantization-group-size says 128
        assert isinstance(products["o"], Int4Weight) and products["o"].group_size == 32
        assert isinstance(products["gate_up"], Int4Weight) and products["gate_up"].group_size == 32
        # a fused product with one 8-bit part, and a 5-bit one: int8, not 4 bits
        assert isinstance(products["qkv"], Int8Weight) and isinstance(products["down"], Int8Weight)
        assert isinstance(products["embed"], Int8Weight)
        prefix = f"model.layers.{layer}"
        fused = torch.cat([state[f"{prefix}.mlp.gate_proj.weight"], state[f"{prefix}.mlp.up_proj.weight"]])
        for kept, reference in ((products["o"], state[f"{prefix}.self_attn.o_proj.weight"]), (products["gate_up"], fused)):
            assert (kept.dequantize() - reference).abs().max() <= reference.abs().max() * 2 ** -7
    assert "keep the file's 4-bit blocks exactly" in caplog.text and "int8 per channel" in caplog.text
    out = engine.generate([[5, 6, 7, 8]], {"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert len(out[0].token_ids) == 4


def test_int8_on_a_gguf_quantizes_every_product_per_channel_and_says_so(cache_of, caplog):
    with caplog.at_level(logging.INFO, logger="common.engine.loading.model_loader"):
        engine = engine_on(cache_of, "int8")
    assert all(isinstance(q, Int8Weight) for q in quantized_of(engine).values())
    assert "quantized again per channel" in caplog.text


def test_llama_rows_come_back_in_the_checkpoints_order(tmp_path, monkeypatch):
    """llama.cpp permutes llama's Q and K rows; the kept groups are put back like the weights."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q4-llama.gguf"
    write_gguf(tiny_model("llama"), "llama", path, qtype=Q.Q4_0)
    engine = engine_on(path, "int4", group=32)
    state = load_state_dict(engine.checkpoint)
    qkv = quantized_of(engine)["qkv"]
    assert isinstance(qkv, Int4Weight)
    reference = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert (qkv.dequantize() - reference).abs().max() <= reference.abs().max() * 2 ** -7
