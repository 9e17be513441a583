"""Where a decode step's time goes: the default model's decode steps under torch.profiler.

    python benchmarks/decode_profile.py [--quantization int8] [--dtype float32] [--kv-cache-dtype auto] [--batch 1,8]
                                        [--drafts 0,4] [--steps 20]

For each batch size (and draft tokens per request, i.e. the width of a speculative verification)
it builds that many requests of 200-token prompts, then profiles ``--steps`` decode steps of the
engine and groups the CPU time by stage: the LM head, attention over the paged cache, sampling, and
the rest (the layers' projections, norms, rotary, activations, Python).  The reference measured in the
same run is the plain decode step at batch 1 (``step_ms`` ratios).

The last line of stdout is one JSON object: per configuration ``step_ms`` and each stage's share.
"""
from __future__ import annotations

import os

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

from benchmarks.bench_util import emit  # noqa: E402


class FixedDrafts:
    """A proposer that always drafts ``k`` tokens (what they are does not change the step's cost)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, request, num_tokens, block_ids):
        return [request.all_token_ids[-1]] * min(self.k, num_tokens)

    def forget(self, request_id):
        pass


class AlwaysPays:
    def allows(self, num_decoding):
        return True

    def observe(self, *args):
        pass


def profile(engine, batch: int, drafts: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    rng = random.Random(batch)
    speculation = engine.scheduler.speculation
    speculation.proposer = FixedDrafts(drafts) if drafts else None
    speculation.gate = AlwaysPays()
    speculation.config = type(speculation.config)(method="ngram" if drafts else "none", num_tokens=max(1, drafts),
                                                  min_accepted=0.0)
    for i in range(batch):
        engine.add_request([rng.randrange(3, 200000) for _ in range(200)],
                           {"max_tokens": 10_000, "temperature": 0, "ignore_eos": True}, request_id=f"b{batch}d{drafts}r{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()  # warm
    originals = []

    def wrap(obj, attr, label):
        fn = getattr(obj, attr)
        originals.append((obj, attr, fn))

        def wrapped(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        wrapped.prefetch_masks = getattr(fn, "prefetch_masks", None)  # the sampler's other entry point
        setattr(obj, attr, wrapped)

    wrap(engine.model, "logits", "stage::lm_head")
    if hasattr(engine.model, "screened_tokens"):  # a greedy row's head: its tokens without whole logits
        wrap(engine.model, "screened_tokens", "stage::lm_head")
    wrap(engine.runner, "sampler", "stage::sampling")
    wrap(engine.attention, "forward", "stage::attention")
    with torch_profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use cost
        engine.step()
    began = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("stage::step"):
                engine.step()
    wall = (time.perf_counter() - began) / steps
    for obj, attr, fn in originals:
        setattr(obj, attr, fn)
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step = totals.get("stage::step", 1.0)
    shares = {
        "lm_head": totals.get("stage::lm_head", 0.0) / step,
        "sampling": totals.get("stage::sampling", 0.0) / step,
        "attention": totals.get("stage::attention", 0.0) / step,
    }
    top = sorted(((k, v) for k, v in totals.items() if not k.startswith("stage::") and not k.startswith("ProfilerStep")),
                 key=lambda kv: -kv[1])[:8]
    # The rest: the layers' projections (an int8 product is a C kernel called through ctypes, which
    # the profiler does not see as an op), norms, rotary, activations and Python.
    shares["projections_and_rest"] = 1.0 - sum(shares.values())
    return {"step_ms": round(wall * 1000, 2), **{k: round(v, 3) for k, v in shares.items()},
            "top_ops": [(k, round(v / step, 3)) for k, v in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantization", default="int8")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="activations and unquantized weights")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's (auto: --dtype's; bfloat16, fp8, ...)")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--drafts", default="0,4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = p.parse_args()
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model="default", dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                 quantization=args.quantization, num_blocks=2048, speculative="ngram",
                                 enable_prefix_caching=False), load_tokenizer=False)
    result: dict = {"benchmark": "decode_profile", "model": "gemma-3-270m (default)",
                    "quantization": args.quantization, "dtype": args.dtype, "kv_cache_dtype": engine.layout.dtype,
                    "threads": args.threads}
    for batch in map(int, args.batch.split(",")):
        for drafts in map(int, args.drafts.split(",")):
            out = profile(engine, batch, drafts, args.steps)
            result[f"b{batch}_d{drafts}"] = out
            print(f"batch {batch} drafts {drafts}: {out}", file=sys.stderr, flush=True)
    base = result.get("b1_d0", {}).get("step_ms")
    if base:
        for key, value in list(result.items()):
            if isinstance(value, dict):
                value["step_over_b1_d0"] = round(value["step_ms"] / base, 2)
    emit(result)


if __name__ == "__main__":
    main()
