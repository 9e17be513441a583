"""Decode steps of few streams with the engine's row padding (``tune_row_padding``) and without it.

One engine, one process: for each batch size the same requests decode with the tuned table and
with none (no padding, the reference), interleaved over several rounds, so both see the same
machine.  Greedy tokens are compared between the two.  The last line of stdout is one JSON object.

    python benchmarks/row_padding.py                  # ~110M-parameter Llama, compiled, one thread
    python benchmarks/row_padding.py --model default  # Gemma 3 270M
"""
from __future__ import annotations

import argparse
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

import torch  # noqa: E402

from benchmarks.bench_util import emit, random_prompts, write_random_llama  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402


def decode(engine: Engine, prompts: list[list[int]], steps: int) -> tuple[list[float], list[list[int]]]:
    """Decode-step times and the greedy tokens of ``prompts`` decoded together."""
    engine.block_pool.reset_prefix_cache()
    ids = [engine.add_request(p, {"max_tokens": steps, "temperature": 0.0, "ignore_eos": True}) for p in prompts]
    tokens = {rid: [] for rid in ids}
    times = []
    while engine.has_unfinished():
        began = time.perf_counter()
        outputs = engine.step()
        if all(len(tokens[rid]) > 0 for rid in ids):  # every prompt computed: a decode step
            times.append(time.perf_counter() - began)
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return times, [tokens[rid] for rid in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random", help="random (a 100m Llama), default (Gemma 3 270M) or a path")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batches", default="1,2,3,4")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per stream")
    p.add_argument("--steps", type=int, default=32, help="tokens each stream decodes per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "random":
        checkpoint = Path(tempfile.gettempdir()) / "pdserve-bench-llama-100m"
        write_random_llama(checkpoint, "100m")
    elif args.model == "default":
        from common.engine.loading.default_model import ensure_default_model

        checkpoint = ensure_default_model()
    else:
        checkpoint = Path(args.model)
    engine = Engine(EngineConfig(model=str(checkpoint), num_blocks=1024, block_size=16, max_num_batched_tokens=2048,
                                 compile=args.compile), load_tokenizer=False)
    tuned = engine.model.row_padding
    print(f"row padding (rows -> rows computed): {tuned}", file=sys.stderr)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    results, same_tokens = {}, True
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = random_prompts(rng, [args.context] * batch, vocab)
        times = {"padded": [], "plain": []}
        tokens = {}
        for _ in range(args.rounds):
            for label, table in (("padded", tuned), ("plain", ())):
                engine.model.set_row_padding(table)
                step_times, tokens[label] = decode(engine, prompts, args.steps)
                times[label] += step_times
        same_tokens &= tokens["padded"] == tokens["plain"]
        padded, plain = statistics.median(times["padded"]), statistics.median(times["plain"])
        results[batch] = {"padded_ms": round(padded * 1e3, 2), "plain_ms": round(plain * 1e3, 2),
                          "speedup": round(plain / padded, 3)}
        print(f"{batch} streams: {results[batch]}", file=sys.stderr)
    engine.model.set_row_padding(tuned)
    emit({"benchmark": "row_padding", "model": checkpoint.name, "threads": args.threads, "compiled": args.compile,
          "context": args.context, "row_padding": list(tuned), "decode_step_by_batch": results,
          "greedy_tokens_identical": same_tokens})


if __name__ == "__main__":
    main()
