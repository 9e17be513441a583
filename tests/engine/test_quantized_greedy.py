"""Greedy steps on an int8 LM head without its logits (``Int8Weight.greedy_tokens``: the VNNI kernel's
argmax entry, or on CPUs without AVX512-VNNI the fp32-sum kernel's): each row's token is the first
maximal index of the products the logits path computes, ties and partial blocks included; a
non-finite product hands the step back to the logits; an engine's greedy tokens are the same either
way."""
from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.models import int8_gemv, int8_vnni
from common.engine.models.int8_gemv import GEMV_MAX_ROWS
from common.engine.models.quantized import Int8Weight
from tests.support.checkpoints import tiny_gemma3_config, write_checkpoint

KERNELS = {"vnni": int8_vnni.argmax_kernel() is not None, "fp32-sums": int8_gemv.argmax_kernel() is not None}
pytestmark = [pytest.mark.skipif(not any(KERNELS.values()), reason="no int8 argmax kernel on this CPU"),
              pytest.mark.slow(seconds=21)]  # a long file: scheduled by its length (tests/conftest.py)


@pytest.fixture(params=sorted(KERNELS))
def vnni(request) -> bool:
    if not KERNELS[request.param]:
        pytest.skip(f"no {request.param} int8 argmax kernel on this CPU")
    return request.param == "vnni"


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20, 70])  # 70: two blocks a pass on VNNI tiles
@pytest.mark.parametrize("out_features", [16, 100, 1000, 4099])  # one block, partial blocks, many chunks
@pytest.mark.parametrize("in_features", [96, 128])  # 128: from 5 rows on AMX tiles where the CPU has them
def test_each_row_takes_the_first_maximal_index_of_the_products(rows, out_features, in_features, vnni):
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g)
    w[out_features // 2] = w[out_features // 3]  # a tie: the earlier index wins
    if out_features // 3 + 16 < out_features:
        w[out_features // 3 + 16] = w[out_features // 3]  # and in the same lane of the next block
    w[-1] = w[0]  # a tie across the first and last chunks
    weight = Int8Weight(w, vnni=vnni)
    x = torch.randn(rows, in_features, generator=g)
    x[0] = w[out_features // 3] * 5  # this row's maximum is the tie
    products = weight.matmul(x)
    tokens = weight.greedy_tokens(x)
    assert tokens is not None and tokens.dtype == torch.int64
    assert tokens.tolist() == torch.argmax(products, dim=-1).tolist()  # torch: the first maximal index
    assert tokens[0].item() == min(out_features // 3, out_features // 2)


def test_a_product_not_finite_hands_the_step_back_to_the_logits(vnni):
    weight = Int8Weight(torch.randn(64, 32), vnni=vnni)
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    assert weight.greedy_tokens(x) is None
    assert weight.greedy_tokens(x[:2]) is not None
    x[2, 5] = float("inf")
    assert weight.greedy_tokens(x) is None
    with pytest.raises(ValueError, match="32 inputs"):
        weight.greedy_tokens(torch.randn(2, 31))


@pytest.mark.skipif(not KERNELS["fp32-sums"], reason="no fp32-sum int8 argmax kernel on this CPU")
def test_off_vnni_only_the_rows_its_product_takes_go_without_logits():
    """``matmul`` takes the fp32-sum kernel up to GEMV_MAX_ROWS rows (the dequantized weight past
    them): the argmax stands in for those products only; bf16 rows take the logits too."""
    weight = Int8Weight(torch.randn(40, 32), vnni=False)
    assert weight.greedy_tokens(torch.randn(GEMV_MAX_ROWS, 32)) is not None
    assert weight.greedy_tokens(torch.randn(GEMV_MAX_ROWS + 1, 32)) is None
    assert weight.greedy_tokens(torch.randn(3, 32, dtype=torch.bfloat16)) is None


def test_an_int8_engine_gives_the_same_greedy_tokens_without_its_logits(tmp_path, monkeypatch):
    directory = write_checkpoint(tiny_gemma3_config(tie_word_embeddings=True), tmp_path / "gemma3")
    prompts = [[5, 9, 13, 200], list(range(3, 40)), [7] * 12]
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    def run():
        engine = Engine(EngineConfig(model=str(directory), quantization="int8", num_blocks=64, block_size=4),
                        load_tokenizer=False)
        return [r.token_ids for r in engine.generate(prompts, greedy)]

    calls = []
    greedy_tokens = Int8Weight.greedy_tokens
    monkeypatch.setattr(Int8Weight, "greedy_tokens", lambda self, x: calls.append(len(x)) or greedy_tokens(self, x))
    without_logits = run()
    assert calls and sum(calls) >= 12 * len(prompts) - len(prompts)  # every decode step took it
    monkeypatch.setattr(Int8Weight, "greedy_tokens", lambda self, x: None)  # the logits path
    assert run() == without_logits
