"""Sampler micro-benchmark: the batched sampler vs the old per-row loop, in the same run.

Rows of a 262144-token vocabulary (Gemma 3's), logits drawn like a real LM's (normal, std 5, so
the 0.95 nucleus holds tens to hundreds of tokens), for each mode and batch size:

    greedy       temperature 0
    temperature  temperature 1
    top_p        temperature 1, top_p 0.95
    top_k        temperature 1, top_k 50
    min_p        temperature 1, min_p 0.05
    penalties    temperature 1, frequency 0.5, presence 0.5, repetition 1.1 (128-token prompts,
                 256 generated tokens)
    logprobs     temperature 1, logprobs 5

The reference is the sampler this project had before: one Python iteration per row over the whole
vocabulary (softmax, sort for top-p, multinomial), extended here with per-row min-p and penalties
for the modes it did not support.  Times are medians of a few repetitions; the last line of stdout
is one JSON object.

    python benchmarks/sampler.py [--quick] [--rows 1,8,32,64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_util import emit, median_ms  # noqa: E402
from common.engine.sampler import Sampler, SamplingRow  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 262144
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=1.0),
    "top_p": SamplingParams(temperature=1.0, top_p=0.95),
    "top_k": SamplingParams(temperature=1.0, top_k=50),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "penalties": SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1),
    "logprobs": SamplingParams(temperature=1.0, logprobs=5),
}


def per_row_reference(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """The old sampler: one Python iteration per row, each over the whole vocabulary."""
    tokens = logits.argmax(dim=-1)
    for i, row in enumerate(rows):
        p = row.sampling_params
        x = logits[i].clone()
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            seen = torch.tensor(list(row.prompt_token_ids) + list(row.output_token_ids))
            x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
            counts = torch.bincount(torch.tensor(list(row.output_token_ids)), minlength=x.numel()).float()
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.greedy:
            tokens[i] = x.argmax()
            continue
        x = x / p.temperature
        if 0 < p.top_k < x.numel():
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        tokens[i] = torch.multinomial(probs, 1)[0]
    if any(row.sampling_params.logprobs is not None for row in rows):
        log_probs = torch.log_softmax(logits, dim=-1)
        for i, row in enumerate(rows):
            if row.sampling_params.logprobs:
                torch.topk(log_probs[i], row.sampling_params.logprobs)
    return tokens.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="rows 1 and 32, fewer repetitions")
    parser.add_argument("--rows", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [1, 32] if args.quick else [int(r) for r in args.rows.split(",")]
    repeats = 3 if args.quick else args.repeats

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (128,), generator=generator).tolist()
    output = torch.randint(0, VOCAB, (256,), generator=generator).tolist()
    results: dict[str, dict[str, dict[str, float]]] = {}
    sampler = Sampler()
    for mode, params in MODES.items():
        results[mode] = {}
        for n in batch_sizes:
            logits = torch.randn(n, VOCAB, generator=generator) * 5.0
            rows = [SamplingRow(params, len(output), prompt, output, request_id=f"r{i}") for i in range(n)]
            sampler(logits.clone(), rows, scratch_logits=True)  # warm-up: scratch buffer, histories
            # fresh copies: the engine hands the sampler logits it may overwrite
            new = median_ms(lambda x: sampler(x, rows, scratch_logits=True), repeats, logits.clone)
            old = median_ms(lambda x: per_row_reference(x, rows), max(1, repeats // 2), logits.clone)
            results[mode][str(n)] = {"batched_ms": round(new, 2), "per_row_loop_ms": round(old, 2),
                                     "speedup": round(old / new, 1)}
            print(f"{mode:12s} rows={n:3d}  batched {new:8.2f} ms   per-row loop {old:9.2f} ms", file=sys.stderr)
    widest = str(max(batch_sizes))
    greedy_ms = results["greedy"][widest]["batched_ms"]
    emit({
        "benchmark": "sampler",
        "vocab": VOCAB,
        "threads": args.threads,
        "rows": batch_sizes,
        "results": results,
        f"over_greedy_at_{widest}_rows": {m: round(r[widest]["batched_ms"] / greedy_ms, 2) for m, r in results.items()},
    })


if __name__ == "__main__":
    main()
