"""Inter-token latency of running decodes while long prompts arrive: chunked vs unchunked prefill.

16 requests decode steadily; every ``--gap`` decode steps a prompt of ``--prompt-len`` tokens
arrives.  With a token budget below the prompt length the prompt is computed in chunks beside the
decodes; with a budget above it, one step computes the whole prompt and every decode waits.
The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_util import emit, percentile, random_prompts, write_random_llama  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402


def run(checkpoint: Path, budget: int, args, vocab: int) -> dict:
    engine = Engine(EngineConfig(model=str(checkpoint), num_blocks=None, kv_memory_fraction=0.3,
                                 max_num_batched_tokens=budget, max_num_seqs=min(64, budget), enable_prefix_caching=False),
                    load_tokenizer=False)
    return measure_itl(engine, num_decoders=args.num_decoders, num_long=args.num_long, prompt_len=args.prompt_len,
                       gap=args.gap, vocab=vocab)


def measure_itl(engine: Engine, *, num_decoders: int, num_long: int, prompt_len: int, gap: int, vocab: int,
                decoder_prompt_len: int = 64) -> dict:
    """``num_decoders`` requests decode while ``num_long`` prompts of ``prompt_len`` tokens arrive,
    one every ``gap`` steps; the decoders' inter-token latencies and the overall token rate."""
    rng = random.Random(0)
    decode_tokens = num_long * gap + 4 * gap
    greedy = {"temperature": 0, "ignore_eos": True}
    decoders = [engine.add_request(p, {**greedy, "max_tokens": decode_tokens})
                for p in random_prompts(rng, [decoder_prompt_len] * num_decoders, vocab)]
    long_prompts = random_prompts(rng, [prompt_len] * num_long, vocab)
    last_token_at: dict[str, float] = {}
    itls: list[float] = []
    steps = tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        if steps % gap == 0 and long_prompts and steps > 0:
            engine.add_request(long_prompts.pop(), {**greedy, "max_tokens": 4})
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outputs:
            tokens += len(o.new_token_ids)
            if o.request_id in decoders:
                if o.request_id in last_token_at:
                    itls.append(now - last_token_at[o.request_id])
                last_token_at[o.request_id] = now
    wall = time.perf_counter() - start
    total_tokens = tokens + num_long * prompt_len + num_decoders * decoder_prompt_len
    return {"itl_p50_ms": percentile(itls, 50) * 1e3, "itl_p99_ms": percentile(itls, 99) * 1e3,
            "tokens_per_s": total_tokens / wall, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny model, fewer prompts: under a minute")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--num-decoders", type=int, default=16)
    parser.add_argument("--num-long", type=int)
    parser.add_argument("--gap", type=int, default=24, help="decode steps between long-prompt arrivals")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = "tiny" if args.quick else "100m"
    args.num_long = args.num_long or (3 if args.quick else 6)
    checkpoint = write_random_llama(Path(tempfile.gettempdir()) / f"pdserve-bench-llama-{size}", size)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    settings = {"chunked_256": 256, "chunked_512": 512, "unchunked": args.prompt_len + 1024}
    results = {}
    for name, budget in settings.items():
        results[name] = run(checkpoint, budget, args, vocab)
        print(name, results[name], file=sys.stderr)
    unchunked = results["unchunked"]
    best = min(("chunked_256", "chunked_512"), key=lambda n: results[n]["itl_p99_ms"])
    emit({
        "benchmark": "chunked_prefill",
        "model": f"llama-{size}-random",
        "prompt_len": args.prompt_len,
        "num_decoders": args.num_decoders,
        "num_long_prompts": args.num_long,
        "itl_p99_ms": {name: round(r["itl_p99_ms"], 2) for name, r in results.items()},
        "itl_p50_ms": {name: round(r["itl_p50_ms"], 2) for name, r in results.items()},
        "tokens_per_s": {name: round(r["tokens_per_s"], 1) for name, r in results.items()},
        "itl_p99_ratio_unchunked_over_chunked": {
            name: round(unchunked["itl_p99_ms"] / results[name]["itl_p99_ms"], 3)
            for name in ("chunked_256", "chunked_512")},
        "throughput_ratio_chunked_over_unchunked": {
            name: round(results[name]["tokens_per_s"] / unchunked["tokens_per_s"], 3)
            for name in ("chunked_256", "chunked_512")},
        "best_chunked_setting": best,
    })


if __name__ == "__main__":
    main()
