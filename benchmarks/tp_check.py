"""Tensor parallelism on CPU (gloo): greedy parity across TP sizes, and where a TP step's time goes.

    python benchmarks/tp_check.py            # a 4-layer Llama (hidden 512, 8 q / 4 kv heads) and a
                                             # Gemma 3 shape with one kv head
    python benchmarks/tp_check.py --quick    # the tests' tiny sizes

One process per rank (torch.multiprocessing, gloo over loopback); rank 0 schedules and samples,
the others follow.  Prints one JSON object as its last line:

    tp2_identical, tp4_identical   greedy tokens equal to TP=1's (same checkpoint, same prompts)
    replicated_kv_identical        one kv head replicated over 2 ranks, equal to TP=1's
    kv_bytes_per_token_per_rank    the KV one rank holds per token, by TP size (its heads only)
    tp2_collective_fraction        at TP=2, the share of rank 0's step time spent in collectives
                                   (all_reduce of the row-parallel outputs and the embedding,
                                   the logits' gather, the token and step broadcasts)
    hetero_p<P>_d<D>_identical     served through real workers (Redis, a gateway, a prefill worker
                                   with TP=P shipping KV to a decode worker with TP=D over TCP):
                                   greedy tokens equal to TP=1's
    hetero_replicated_identical    the same for the one-kv-head model, p2->d1 and p1->d2
    kv_bytes_shipped_per_token     the KV bytes that moved per prompt token, by pair; equal to
    kv_bytes_owned_per_token       what the decode worker's ranks own per token (every rank its
                                   heads), not a whole layer per rank
"""
from __future__ import annotations

import argparse
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

from benchmarks.bench_util import emit  # noqa: E402

BLOCK_SIZE = 16
PAIRS = [("p1", "d1"), ("p2", "d1"), ("p1", "d2"), ("p2", "d2")]  # p<prefill TP>, d<decode TP>

PROMPTS = [[5, 17, 99, 230, 11] * 8, list(range(3, 120)), [400, 401, 7, 7, 7, 9, 300, 12, 1, 250] * 4]


def _timed_collectives(seconds: list[float]) -> None:
    """Count the time rank 0 spends in torch.distributed's collectives."""
    import torch.distributed as dist

    for name in ("all_reduce", "gather", "broadcast"):
        original = getattr(dist, name)

        def timed(*args, _original=original, **kwargs):
            began = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - began
        setattr(dist, name, timed)


def _rank(rank: int, size: int, directory: str, max_new: int, out: str) -> None:
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    engine = Engine(EngineConfig(model=directory, num_blocks=512, block_size=BLOCK_SIZE, tensor_parallel_size=size),
                    load_tokenizer=False)
    if rank != 0:
        engine.follow()
        return
    collective = [0.0]
    if size > 1:
        _timed_collectives(collective)
    engine.generate(PROMPTS[:1], {"max_tokens": 2, "temperature": 0})  # warm-up
    collective[0] = 0.0
    began = time.perf_counter()
    results = engine.generate(PROMPTS, {"max_tokens": max_new, "temperature": 0, "ignore_eos": True})
    seconds = time.perf_counter() - began
    engine.stop_followers()
    kv_bytes = engine.kv_cache.block_nbytes // engine.config.block_size
    Path(out).write_text(json.dumps({"tokens": [r.token_ids for r in results], "seconds": seconds,
                                     "collective_seconds": collective[0], "kv_bytes_per_token": kv_bytes}))


def run(directory: Path, size: int, max_new: int) -> dict:
    from tests.support.rank_group import run_group

    out = Path(tempfile.mkdtemp()) / "result.json"
    run_group(_rank, size, str(directory), max_new, str(out))
    return json.loads(out.read_text())


async def _served(stack, prefill: str, decode: str, max_new: int, probe: list[int]) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt on ``decode`` prefilled by ``prefill``, and the KV bytes per
    token that moved for ``probe``, a prompt no worker has seen (nothing of it cached anywhere)."""
    from tests.support.scripted_peer import Stream, WorkerClient

    tokens = []
    async with WorkerClient(stack, decode) as client:
        for prompt in [*PROMPTS, probe]:
            stream = Stream(client, prompt, prefill_worker_id=prefill, max_tokens=max_new)
            tokens.append(await stream.tokens())
            first = stream.frames[0]
            if first.prefill_worker != prefill or first.prefill_fallback:
                raise RuntimeError(f"{prefill}->{decode}: the prompt was not prefilled where it was sent")
    if first.num_cached_tokens:
        raise RuntimeError(f"{prefill}->{decode}: the probe prompt hit a cache")
    return tokens[:-1], first.kv_transfer_bytes / (-(-len(probe) // BLOCK_SIZE) * BLOCK_SIZE)


def served(directory: Path, pairs: list[tuple[str, str]], max_new: int, redis_url: str) -> dict:
    """Each pair's tokens and KV bytes per token, through real workers of those TP sizes."""
    import asyncio

    from tests.support.cluster import running_cluster

    names = sorted({name for pair in pairs for name in pair})
    with tempfile.TemporaryDirectory() as logs, running_cluster(
            directory, Path(logs), redis_url, prefill=0, decode=0,
            worker_args=["--num-blocks", "256", "--block-size", str(BLOCK_SIZE), "--no-compile"]) as stack:
        for name in names:
            role = "prefill" if name[0] == "p" else "decode"
            stack.role_args[role] = ["--tensor-parallel-size", name[1:]]
            stack.start_worker(name, role)
        stack.wait_for_workers(prefill=sum(n[0] == "p" for n in names), decode=sum(n[0] == "d" for n in names),
                               timeout=600)
        out = {}
        for index, (prefill, decode) in enumerate(pairs):
            probe = [300 + index, *range(10, 10 + 4 * BLOCK_SIZE - 1)]
            tokens, shipped = asyncio.run(_served(stack, prefill, decode, max_new, probe))
            owned = stack.stats(decode)["kv_bytes_per_block"] // BLOCK_SIZE
            out[f"{prefill}_{decode}"] = {"tokens": tokens, "shipped_per_token": shipped,
                                          "owned_per_token": owned}
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    args = p.parse_args()
    from tests.support.checkpoints import tiny_gemma3_config, tiny_llama_config, write_checkpoint, write_tokenizer

    root = Path(tempfile.mkdtemp(prefix="tp-check-"))
    llama_shape = dict(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    if not args.quick:
        llama_shape.update(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, vocab_size=8192)
    llama = write_checkpoint(tiny_llama_config(**llama_shape), root / "llama")
    gemma = write_checkpoint(tiny_gemma3_config(max_position_embeddings=2048), root / "gemma")
    for directory in (llama, gemma):  # the served stacks' gateway tokenizes
        write_tokenizer(directory)
    base = run(llama, 1, args.max_new)
    tp2, tp4 = run(llama, 2, args.max_new), run(llama, 4, args.max_new)
    gemma1, gemma2 = run(gemma, 1, args.max_new), run(gemma, 2, args.max_new)
    hetero = served(llama, PAIRS, args.max_new, args.redis_url)
    replicated = served(gemma, [("p2", "d1"), ("p1", "d2")], args.max_new, args.redis_url)
    emit({
        "benchmark": "tp_check", "model": "tiny" if args.quick else "llama-4x512 (8 q / 4 kv heads)",
        "tp2_identical": tp2["tokens"] == base["tokens"], "tp4_identical": tp4["tokens"] == base["tokens"],
        "replicated_kv_identical": gemma2["tokens"] == gemma1["tokens"],
        **{f"hetero_{pair}_identical": result["tokens"] == base["tokens"] for pair, result in hetero.items()},
        "hetero_replicated_identical": all(r["tokens"] == gemma1["tokens"] for r in replicated.values()),
        "kv_bytes_shipped_per_token": {pair: r["shipped_per_token"] for pair, r in hetero.items()},
        "kv_bytes_owned_per_token": {pair: r["owned_per_token"] for pair, r in hetero.items()},
        "replicated_kv_bytes_shipped_per_token": {pair: r["shipped_per_token"] for pair, r in replicated.items()},
        "kv_bytes_per_token_per_rank": {"tp1": base["kv_bytes_per_token"], "tp2": tp2["kv_bytes_per_token"],
                                        "tp4": tp4["kv_bytes_per_token"]},
        "tp2_collective_fraction": round(tp2["collective_seconds"] / tp2["seconds"], 3),
        "tp1_seconds": round(base["seconds"], 3), "tp2_seconds": round(tp2["seconds"], 3),
        "tp4_seconds": round(tp4["seconds"], 3),
    })


if __name__ == "__main__":
    main()
