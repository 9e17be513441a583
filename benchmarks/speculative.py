"""Speculative decoding against plain decoding, offline, one run.

    python benchmarks/speculative.py [--quick] [--threads N]

The default model (Gemma 3 270M, a base model), ignore_eos, 64-128 output tokens per request
(``--quick``: 32-64), prompts tokenized from real text:

- **high overlap**: answers that repeat spans of their prompt -- a passage of Newton's *Opticks*
  (benchmarks/data/opticks.txt) to copy out, a passage to quote in answer to a question, and
  Python functions of this repository to reproduce with one change;
- **random**: random token-id prompts, answers sampled at temperature 1 (seeded per request): random
  text, with little to look up -- what speculation costs when it cannot help.  (Greedy answers to
  random prompts are no test of that: a base model then falls into loops the lookup predicts.)

Each at concurrency 1 (8 requests one after another; ``--quick``: 4) and 8 (24 requests, 8 in flight,
a finished one replaced at once; ``--quick``: 12), in fp32 and with int8
weights, with speculation off and on (``--speculative ngram``, 4 draft tokens, n-grams 2-4; the
engine's defaults otherwise); the same engine settings and threads for both.  In fp32, a draft
model too: the default model itself with int8 weights (``--speculative draft --draft-model <the
same> --draft-quantization int8``; Gemma 3 has no smaller model of its tokenizer).  Throughput is
output tokens over wall time, prompts included, over two runs of each engine in the order off, on,
on, off (this VM's speed drifts by tens of percent within a minute; one run each was off then on).

The last line of stdout is one JSON object: ``speedup_high_overlap_c1`` and ``_c8`` (fp32, on / off),
``ratio_random_c1`` and ``_c8``, the same with an ``int8_`` prefix (int8 weights, n-gram) and a
``draft_`` prefix (fp32, the int8 draft), ``greedy_identical`` (every
greedy request's tokens equal with speculation on and off, in both precisions),
``seeded_identical_requests`` (the seeded sampled ones whose tokens are all equal: each token is
drawn from (seed, position), so only rounding differences between a step of k + 1 positions and one
of 1 can tell them apart), and per run the
acceptance rate, tokens per verification and the mean verify and plain decode step times.
"""
from __future__ import annotations

import os

import argparse  # noqa: E402
import ast  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

from benchmarks.bench_util import emit  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "opticks.txt"
SCHEMES = [("fp32", "none"), ("int8", "int8")]
DRAFT_QUANTIZATION = "int8"  # the draft model: the default model itself, these weights
CONCURRENCY = (1, 8)


def passages(count: int, words: int, seed: int) -> list[str]:
    body = TEXT.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    starts = [rng.randrange(2000, len(body) - words) for _ in range(count)]
    return [" ".join(body[s : s + words]) for s in starts]


def functions(count: int) -> list[str]:
    """Sources of this repository's functions of 8-30 lines."""
    root = Path(__file__).resolve().parent.parent / "common" / "engine"
    found = []
    for path in ("scheduler.py", "sampler.py", "engine.py"):
        source = (root / path).read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno <= 30:
                found.append(textwrap.dedent(ast.get_source_segment(source, node, padded=True)))
    return found[:count]


def high_overlap_prompts(n: int) -> list[str]:
    texts = passages(n, 110, seed=1)
    sources = functions(n)
    prompts = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = texts[i]
            prompts.append(f"Passage:\n{text}\n\nThe passage above, copied out word for word:\n{' '.join(text.split()[:4])}")
        elif kind == 1:
            text = texts[i]
            prompts.append(f"Document:\n{text}\n\nQuestion: What does the document say, exactly? Quote it in full.\n"
                           f"Answer: The document says: \"{' '.join(text.split()[:3])}")
        else:
            source = sources[i % len(sources)]
            prompts.append(f"```python\n{source}\n```\n\nThe same function, with `self` renamed to `this`:\n\n```python\n"
                           f"{source.splitlines()[0].replace('self', 'this')}\n")
    return prompts


def run(engine, prompts: list[list[int]], max_tokens: int, concurrency: int, sampled: bool
        ) -> tuple[int, float, list[list[int]], object]:
    """Every prompt, ``concurrency`` in flight (a finished request is replaced at once); request i
    asks for between half of ``max_tokens`` and all of it (the same on every run), so finishes --
    and the prompts that replace them -- are spread as in real traffic, with speculation or without.
    Returns the output tokens, the wall time, each request's tokens and the speculation counters."""
    lengths = random.Random(1).choices(range(max_tokens // 2, max_tokens + 1), k=len(prompts))
    from common.engine.speculative.speculation import SpeculationStats

    engine.scheduler.speculation.stats = SpeculationStats()
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    in_flight = 0
    began = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            params = {"max_tokens": lengths[i], "ignore_eos": True, "temperature": 1.0 if sampled else 0.0,
                      "seed": i if sampled else None}
            engine.add_request(prompt, params, request_id=f"r{i}")
            in_flight += 1
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            in_flight -= output.finished
    wall = time.perf_counter() - began
    outputs = [tokens[f"r{i}"] for i in range(len(prompts))]
    return sum(map(len, outputs)), wall, outputs, engine.scheduler.speculation.stats


def merged(runs: list) -> tuple[float, list[list[int]], dict]:
    """Runs of ``run`` as one: output tokens per second over them all, the first run's tokens, the
    counters summed."""
    from common.engine.speculative.speculation import SpeculationStats

    stats = SpeculationStats(**{name: sum(getattr(r[3], name) for r in runs) for name in vars(runs[0][3])})
    return sum(r[0] for r in runs) / sum(r[1] for r in runs), runs[0][2], stats.as_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = p.parse_args()
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    torch.set_num_threads(args.threads)
    max_tokens = 64 if args.quick else 128
    n = 12 if args.quick else 24  # requests per workload; at concurrency 1 the first 8 (4 quick)
    result: dict = {"benchmark": "speculative", "model": "gemma-3-270m (default)", "threads": args.threads,
                    "max_tokens": max_tokens, "requests": n, "num_speculative_tokens": 4}
    identical = {"high_overlap": [0, 0], "random": [0, 0]}  # requests with equal tokens, requests
    from common.engine.loading.default_model import ensure_default_model

    methods = {"ngram": {"speculative": "ngram"},
               "draft": {"speculative": "draft", "draft_model": str(ensure_default_model()),
                         "draft_quantization": DRAFT_QUANTIZATION}}
    for scheme_name, scheme in SCHEMES:
        # the draft model on the full-precision target only (on an int8 one it would be itself)
        speculative = ["ngram", "draft"] if scheme == "none" else ["ngram"]
        engines = {spec: Engine(EngineConfig(model="default", quantization=scheme, num_blocks=1024,
                                             num_speculative_tokens=4, enable_prefix_caching=False,
                                             **methods.get(spec, {})))
                   for spec in ("none", *speculative)}
        tokenizer = engines["none"].tokenizer
        rng = random.Random(0)
        workloads = {
            "high_overlap": [tokenizer(t).input_ids for t in high_overlap_prompts(n)],
            "random": [[rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(64, 256))] for _ in range(n)],
        }
        for engine in engines.values():
            engine.generate([workloads["random"][0][:8]], {"max_tokens": 4, "temperature": 0})  # warm-up
        for workload, all_prompts in workloads.items():
            for c in CONCURRENCY:
                sampled = workload == "random"
                prompts = all_prompts if c > 1 else all_prompts[: 4 if args.quick else 8]
                # Off, on, then on, off: a host whose speed drifts during the runs weighs on both alike.
                runs: dict[str, list] = {name: [] for name in ("none", *speculative)}
                for order in (list(runs), list(runs)[::-1]):
                    for name in order:
                        runs[name].append(run(engines[name], prompts, max_tokens, c, sampled))
                off, off_tokens, _ = merged(runs["none"])
                for spec in speculative:
                    on, on_tokens, stats = merged(runs[spec])
                    identical[workload][0] += sum(a == b for a, b in zip(on_tokens, off_tokens))
                    identical[workload][1] += len(prompts)
                    prefix = "draft_" if spec == "draft" else "" if scheme_name == "fp32" else f"{scheme_name}_"
                    report(result, prefix, workload, c, len(prompts), off, on, stats)
                    print(f"{scheme_name} {spec} {workload} c={c}: off {off:.1f} tok/s, on {on:.1f} tok/s "
                          f"(x{on / off:.2f}, acceptance {stats['spec_acceptance_rate']:.2f}, "
                          f"{stats['spec_mean_tokens_per_verification']:.2f} tokens/verification)", file=sys.stderr,
                          flush=True)
        del engines
    result["greedy_identical"] = identical["high_overlap"][0] == identical["high_overlap"][1]
    result["seeded_identical_requests"] = "{}/{}".format(*identical["random"])
    emit(result)


def report(result: dict, prefix: str, workload: str, c: int, requests: int, off: float, on: float,
           stats: dict) -> None:
    """One run's fields: ``prefix`` names the weights and the proposer (``""``: fp32, n-gram)."""
    key = f"{prefix}{workload}_c{c}"
    result[f"{key}_off_tok_s"], result[f"{key}_on_tok_s"] = round(off, 2), round(on, 2)
    result[f"{key}_acceptance_rate"] = round(stats["spec_acceptance_rate"], 3)
    result[f"{key}_tokens_per_verification"] = round(stats["spec_mean_tokens_per_verification"], 2)
    result[f"{key}_batch_paused_steps"] = stats["spec_batch_paused_steps_total"]
    result[f"{key}_requests"] = requests
    if stats["spec_verify_steps_total"] and stats["decode_only_steps_total"]:
        result[f"{key}_verify_over_decode_step"] = round(
            (stats["spec_verify_step_seconds_total"] / stats["spec_verify_steps_total"])
            / (stats["decode_only_step_seconds_total"] / stats["decode_only_steps_total"]), 2)
    ratio_name = "speedup" if workload == "high_overlap" else "ratio"
    result[f"{prefix}{ratio_name}_{workload}_c{c}"] = round(on / off, 3)


if __name__ == "__main__":
    main()
