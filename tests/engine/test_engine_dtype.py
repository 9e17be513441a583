"""The engine's dtype choice (``engine._pick_dtype``): auto is fp32 on CPU and bf16 on CUDA; bf16
activations over int8 / int4 weights on CPU are served but named as the slow combination, with the
setting that keeps the KV cache as small."""
from __future__ import annotations

import logging

import pytest
import torch

from common.engine.engine import _pick_dtype

CPU = torch.device("cpu")


def slow_combination_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "--kv-cache-dtype bfloat16" in r.getMessage()]


def test_auto_is_fp32_on_cpu_and_bf16_on_cuda():
    assert _pick_dtype("auto", CPU) == torch.float32
    assert _pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_bf16_rows_over_integer_weights_on_cpu_are_named_with_the_faster_setting(caplog, quantization):
    with caplog.at_level(logging.WARNING, logger="common.engine.engine"):
        assert _pick_dtype("bfloat16", CPU, quantization) == torch.bfloat16  # served as asked
    (message,) = slow_combination_warnings(caplog)
    assert quantization in message and "--dtype float32" in message


@pytest.mark.parametrize("dtype, quantization, device", [
    ("float32", "int8", "cpu"), ("bfloat16", "none", "cpu"), ("bfloat16", "fp8", "cpu"), ("auto", "int8", "cpu"),
    ("bfloat16", "int8", "cuda"),
])
def test_other_combinations_are_not_warned_about(caplog, dtype, quantization, device):
    with caplog.at_level(logging.WARNING, logger="common.engine.engine"):
        _pick_dtype(dtype, torch.device(device), quantization)
    assert slow_combination_warnings(caplog) == []
