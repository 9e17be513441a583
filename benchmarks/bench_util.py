"""Shared helpers for the benchmarks: random checkpoints, workloads, percentiles, JSON output."""
from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch


def write_random_llama(directory: Path, size: str = "100m", seed: int = 0) -> Path:
    """A Llama-architecture checkpoint with random weights: ``100m`` (about 110M parameters) or ``tiny``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shapes = {
        "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=12, num_key_value_heads=4),
        "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2),
    }[size]
    config = LlamaConfig(**shapes, max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def log_uniform_lengths(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    return [int(round(math.exp(rng.uniform(math.log(low), math.log(high))))) for _ in range(count)]


def random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def median_ms(fn, repeats: int, fresh_input=None) -> float:
    """The median wall time of ``repeats`` calls of ``fn``, in ms.  With ``fresh_input``, each call
    takes a new ``fresh_input()`` (made outside the timing: say a copy ``fn`` may overwrite)."""
    times = []
    for _ in range(repeats):
        args = () if fresh_input is None else (fresh_input(),)
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def emit(result: dict) -> None:
    """Print the benchmark's result as one JSON object on the last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
