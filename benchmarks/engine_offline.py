"""Offline throughput: this engine vs transformers generate (static batches) and generate_batch,
and sampled vs greedy throughput of this engine.

Same model, same workload (prompt lengths log-uniform, output lengths uniform, ignore_eos), same
torch thread count, one run.  The last line of stdout is one JSON object.

    python benchmarks/engine_offline.py            # 128 requests, ~110M-parameter Llama
    python benchmarks/engine_offline.py --quick    # a small version, under a minute
    python benchmarks/engine_offline.py --model default --skip-hf --sampling nucleus
        # the default model (Gemma 3 270M); nucleus (temperature 1, top_p 0.95) and the same
        # workload greedy: sampled_over_greedy = sampled tok/s / greedy tok/s

``--sampling``: greedy (temperature 0), default (temperature 1, no filters) or nucleus.  Greedy
parity (``outputs_match``) compares the first requests, one by one, with transformers' generate().
"""
from __future__ import annotations

import argparse
import logging  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

import torch  # noqa: E402

from benchmarks.bench_util import emit, log_uniform_lengths, random_prompts, write_random_llama  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402


SAMPLING = {
    "greedy": {"temperature": 0.0},
    "default": {"temperature": 1.0},
    "nucleus": {"temperature": 1.0, "top_p": 0.95},
}


def make_engine(checkpoint: Path, args) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), num_blocks=args.num_blocks, kv_memory_fraction=0.3,
                               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, dtype=args.dtype,
                               attention_backend=args.attention_backend, compile=args.compile), load_tokenizer=False)


def run_ours(engine: Engine, prompts, output_lens, sampling: str = "greedy") -> tuple[float, list[list[int]], float, float]:
    engine.generate([prompts[0][:8]], {"max_tokens": 2, **SAMPLING[sampling]})  # warm-up
    # Every run computes its prompts: a run after another on the same engine would otherwise find
    # them in the prefix cache and skip their prefill.
    engine.block_pool.reset_prefix_cache()
    engine.runner.forward_seconds = 0.0
    ids = [engine.add_request(p, {"max_tokens": n, "ignore_eos": True, **SAMPLING[sampling]})
           for p, n in zip(prompts, output_lens)]
    outputs = {rid: [] for rid in ids}
    batch_sizes = []
    start = time.perf_counter()
    while engine.has_unfinished():
        batch_sizes.append(len(engine.scheduler.running))
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
    wall = time.perf_counter() - start
    overhead = (wall - engine.runner.forward_seconds) / wall
    mean_batch = sum(batch_sizes) / len(batch_sizes)
    return wall, [outputs[rid] for rid in ids], overhead, mean_batch


def run_hf_generate(model, prompts, output_lens, batch_size: int) -> tuple[float, list[list[int]]]:
    """Static batches, left-padded; each batch runs until its longest request is done."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i : i + batch_size], output_lens[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs += [row[width : width + n].tolist() for row, n in zip(out, lens)]
    return time.perf_counter() - start, outputs


def run_hf_generate_batch(model, prompts, output_lens) -> float:
    """transformers' continuous batching, one request per prompt with its own max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(output_lens))
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, warmup=False) as manager:
        for i, (p, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        done = 0
        while done < len(prompts):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                done += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and workload, under a minute")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--checkpoint", type=Path, help="reuse/put the random checkpoint here")
    parser.add_argument("--size", choices=("100m", "tiny"), help="model size (default: 100m, tiny with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="random",
                        help="random (a random Llama, see --size), default (Gemma 3 270M) or a checkpoint directory")
    parser.add_argument("--sampling", choices=tuple(SAMPLING), default="greedy",
                        help="not greedy: the same workload also runs greedy, for sampled_over_greedy")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="the decoder layers compiled (torch.compile), as workers run them by default")
    parser.add_argument("--num-blocks", type=int, help="KV blocks (default: 30%% of free memory)")
    parser.add_argument("--skip-hf", action="store_true",
                        help="no transformers throughput runs (greedy parity on the first requests still runs)")
    parser.add_argument("--prompt-range", type=int, nargs=2, metavar=("LO", "HI"))
    parser.add_argument("--output-range", type=int, nargs=2, metavar=("LO", "HI"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    if args.quick:
        size, count, prompt_range, output_range = "tiny", args.num_requests or 32, (32, 256), (8, 48)
    else:
        size, count, prompt_range, output_range = "100m", args.num_requests or 128, (32, 1024), (16, 256)
    size = args.size or size
    prompt_range = tuple(args.prompt_range or prompt_range)
    output_range = tuple(args.output_range or output_range)
    if args.model == "random":
        checkpoint = args.checkpoint or Path(tempfile.gettempdir()) / f"pdserve-bench-llama-{size}"
        write_random_llama(checkpoint, size)
        model_name = f"llama-{size}-random"
    elif args.model == "default":
        from common.engine.loading.default_model import ensure_default_model

        checkpoint = ensure_default_model()
        model_name = checkpoint.name
    else:
        checkpoint = Path(args.model)
        model_name = checkpoint.name
    rng = random.Random(args.seed)
    prompt_lens = log_uniform_lengths(rng, count, *prompt_range)
    output_lens = [rng.randint(*output_range) for _ in range(count)]
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    prompts = random_prompts(rng, prompt_lens, vocab)
    useful_tokens = sum(output_lens)

    engine = make_engine(checkpoint, args)
    sampled = {}
    if args.sampling != "greedy":  # sampled first, then greedy: any warm-up advantage goes to greedy
        sampled_wall, _out, sampled_overhead, _batch = run_ours(engine, prompts, output_lens, args.sampling)
        sampled = {"sampling": args.sampling, "sampled_tok_s": round(useful_tokens / sampled_wall, 2),
                   "sampled_overhead_fraction": round(sampled_overhead, 4)}
        print(f"ours {args.sampling}: {sampled_wall:.1f} s", file=sys.stderr)
    ours_wall, ours_out, overhead, mean_batch = run_ours(engine, prompts, output_lens)
    print(f"ours greedy: {ours_wall:.1f} s, mean batch {mean_batch:.1f}, overhead {overhead:.3f}", file=sys.stderr)
    if sampled:
        sampled["sampled_over_greedy"] = round(sampled["sampled_tok_s"] / (useful_tokens / ours_wall), 3)
    attention, compiled = engine.attention.name, engine.model.stages.compiled
    del engine

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf = {}
    if not args.skip_hf:
        hf_wall, hf_out = run_hf_generate(model, prompts, output_lens, batch_size=16)
        print(f"hf generate: {hf_wall:.1f} s", file=sys.stderr)
        hf_batch_wall = run_hf_generate_batch(model, prompts, output_lens)
        print(f"hf generate_batch: {hf_batch_wall:.1f} s", file=sys.stderr)
        hf = {
            "hf_generate_tok_s": round(useful_tokens / hf_wall, 2),
            "hf_generate_batch_tok_s": round(useful_tokens / hf_batch_wall, 2),
            "ratio_vs_hf_generate": round(hf_wall / ours_wall, 3),
            "ratio_vs_hf_generate_batch": round(hf_batch_wall / ours_wall, 3),
            "agreement_with_padded_hf_generate": round(sum(a == b for a, b in zip(ours_out, hf_out)) / count, 3),
        }

    # Greedy parity on requests compared one by one, unpadded (padding itself perturbs the reference).
    compared = min(4, count)
    ref = []
    for p, n in zip(prompts[:compared], output_lens[:compared]):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    outputs_match = ours_out[:compared] == ref

    emit({
        "benchmark": "engine_offline",
        "model": model_name,
        "dtype": args.dtype,
        "attention_backend": attention,
        "compiled": compiled,
        "num_requests": count,
        "prompt_tokens": sum(prompt_lens),
        "output_tokens": useful_tokens,
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "ours_mean_batch": round(mean_batch, 1),
        "ours_tok_s": round(useful_tokens / ours_wall, 2),
        **hf,
        **sampled,
        "overhead_fraction": round(overhead, 4),
        "outputs_match": outputs_match if args.dtype == "float32" else None,  # parity is defined in fp32
        "requests_compared": compared,
    })


if __name__ == "__main__":
    main()
