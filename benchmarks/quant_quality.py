"""What quantized weights cost in quality, measured on the default model (Gemma 3 270M).

On AVX512-VNNI CPUs the int8 and int4 products also round their activations to int8 (per row and
group of inputs: ``common/engine/models/quantized.py``); what is measured here includes that.

    python benchmarks/quant_quality.py            # the whole text, 64 prompts x 64 tokens
    python benchmarks/quant_quality.py --quick    # 4k tokens of it, 16 prompts x 32 tokens

Perplexity: this project's engine, teacher-forced over ``benchmarks/data/opticks.txt`` (Isaac
Newton, *Opticks*, 4th edition 1730, the opening ~110 kB: public domain; 26k tokens of the
default tokenizer) in windows of ``--window`` tokens, every token scored once (the first of each
window only as context).  Greedy agreement: 64 prompts (windows of the same text at spread
offsets, 32 tokens each), 64 greedy tokens each, quantized against full precision (fp32): the
share of generated tokens equal position by position up to the first difference, and the share of
prompts whose 64 tokens are all equal.

The last line of stdout is one JSON object: ``ppl_<scheme>`` and ``<scheme>_ppl_delta``
(relative to fp32), ``<scheme>_greedy_agreement`` (tokens before the first difference / all) and
``<scheme>_greedy_identical_prompts`` for int8 and int4 (and fp8 with ``--fp8``: its CPU path
is a reference, slow; with ``--kv-bf16`` also fp32, int8 and int4 over a bf16 KV cache,
``<scheme>_kv_bf16_*``, with ``--kv-fp8`` over an fp8 one, ``<scheme>_kv_fp8_*``, against the same fp32
reference), and ``<scheme>_weight_mb`` (the weights
as stored).  int4 on this GGUF keeps the file's 4-bit blocks as they are and its wider ones at int8
(``common.engine.loading.gguf_blocks``).
"""
from __future__ import annotations

import argparse
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

from benchmarks.bench_util import emit  # noqa: E402

TEXT = Path(__file__).with_name("data") / "opticks.txt"
LOGIT_ROWS = 128  # rows of logits (vocabulary-wide) made at once
KV_SUFFIXES = {"auto": "", "bfloat16": "_kv_bf16", "fp8": "_kv_fp8"}  # a result's name, by its KV cache's dtype


def engine_for(scheme: str, group_size: int, window: int, kv_cache_dtype: str = "auto"):
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    return Engine(EngineConfig(model="default", dtype="float32", kv_cache_dtype=kv_cache_dtype, quantization=scheme,
                               quantization_group_size=group_size, num_blocks=max(512, 2 * window // 16 + 8),
                               max_num_seqs=64), load_tokenizer=False)


def window_nll(engine, tokens: list[int]) -> tuple[float, int]:
    """Sum of -log p(token | everything before it in the window), and how many tokens were scored."""
    import torch

    from common.engine.attention.interface import AttentionRequest

    n = len(tokens)
    bs = engine.config.block_size
    blocks = list(range(-(-n // bs)))
    meta = engine.attention.prepare([AttentionRequest(0, n, n, blocks)], engine.device)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(tokens), torch.arange(n), engine.kv_cache, meta, engine.attention)
        total = 0.0
        for start in range(0, n - 1, LOGIT_ROWS):
            stop = min(n - 1, start + LOGIT_ROWS)
            logits = engine.model.logits(hidden[start:stop]).float()
            targets = torch.tensor(tokens[start + 1 : stop + 1])
            total -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
    return total, n - 1


def perplexity(engine, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window - 1):  # windows overlap by one token: every token scored once
        part = ids[start : start + window]
        if len(part) < 2:
            break
        a, b = window_nll(engine, part)
        nll, count = nll + a, count + b
    return math.exp(nll / count)


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = engine.generate(prompts, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return [r.token_ids for r in out]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(tokens before each prompt's first difference / all tokens, prompts all equal / prompts)."""
    same = 0
    for a, b in zip(reference, other):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    total = sum(len(a) for a in reference)
    return same / total, sum(a == b for a, b in zip(reference, other)) / len(reference)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--window", type=int, default=1024)
    from common.engine.models.quantization_scheme import Quantization

    p.add_argument("--group-size", type=int, default=Quantization.group_size, help="int4 inputs per group")
    p.add_argument("--fp8", action="store_true", help="also fp8 (its CPU path dequantizes every product: slow)")
    p.add_argument("--kv-bf16", action="store_true",
                   help="also each scheme with a bf16 KV cache (--kv-cache-dtype bfloat16): <name>_kv_bf16")
    p.add_argument("--kv-fp8", action="store_true",
                   help="also each scheme with an fp8 KV cache (--kv-cache-dtype fp8): <name>_kv_fp8")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from common.engine.loading.checkpoint_path import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_checkpoint("default")))
    ids = tokenizer(TEXT.read_text())["input_ids"]
    if args.quick:
        ids = ids[:4096]
    num_prompts, new_tokens = (16, 32) if args.quick else (64, 64)
    stride = max(1, (len(ids) - 32) // num_prompts)
    prompts = [ids[i * stride : i * stride + 32] for i in range(num_prompts)]
    schemes = [(s, "auto") for s in ["none", "int8", "int4"] + (["fp8"] if args.fp8 else [])]
    schemes += [(s, "bfloat16") for s in ("none", "int8", "int4")] if args.kv_bf16 else []
    schemes += [(s, "fp8") for s in ("none", "int8", "int4")] if args.kv_fp8 else []
    result: dict = {"benchmark": "quant_quality", "model": "gemma-3-270m (default)", "text_tokens": len(ids),
                    "window": args.window, "int4_group_size": args.group_size, "prompts": num_prompts,
                    "greedy_tokens": new_tokens}
    reference = None
    for scheme, kv_cache_dtype in schemes:
        began = time.perf_counter()
        engine = engine_for(scheme, args.group_size, args.window, kv_cache_dtype)
        ppl = perplexity(engine, ids, args.window)
        tokens = greedy(engine, prompts, new_tokens)
        name = ("fp32" if scheme == "none" else scheme) + KV_SUFFIXES[kv_cache_dtype]
        result[f"ppl_{name}"] = round(ppl, 4)
        if kv_cache_dtype == "auto":
            result[f"{name}_weight_mb"] = round(engine.model.weight_bytes() / 1e6, 1)
        if reference is None:
            reference = tokens
        else:
            result[f"{name}_ppl_delta"] = round(ppl / result["ppl_fp32"] - 1, 5)
            share, identical = agreement(reference, tokens)
            result[f"{name}_greedy_agreement"] = round(share, 4)
            result[f"{name}_greedy_identical_prompts"] = round(identical, 4)
        print(f"{name}: perplexity {ppl:.4f} ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
        del engine
    emit(result)


if __name__ == "__main__":
    main()
