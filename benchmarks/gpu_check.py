"""The GPU check: one command that tells whether the CUDA path is right and how fast it is.

    python benchmarks/gpu_check.py                  # one CUDA GPU (an H200: a few minutes expected, 8 at most)
    python benchmarks/gpu_check.py --cpu-interpret  # step 1 only, on CPU under Triton's interpreter
    python benchmarks/gpu_check.py --smoke          # every step on tiny shapes (tests this script)

1. **Attention.** The Triton backend (and flash-attn, when installed, at the block sizes it pages)
   against the torch path on packed batches: prompt chunks, decodes, mixed steps, sliding
   windows, GQA, block sizes 16, 24 and 256 (``common.engine.attention.check``). On a GPU in bf16,
   plus model-sized heads and contexts; under ``--cpu-interpret`` in fp32 on small shapes.
2. **Greedy parity.** A random Llama-shaped checkpoint, fp32, chunked prompts beside decodes:
   our engine's greedy tokens against transformers' ``generate()`` on the same GPU, request by
   request.
3. **Speed.** A random Llama-3-8B-shaped model in bf16 (``load_format="dummy"``: config.json only):
   decode step time at batch 1, 32 and 128 against the HBM roofline (bytes of the weights one
   decode step reads / 4.8 TB/s), and prefill MFU (model FLOPs of a step of whole prompts / step
   time / 989 TFLOP/s, H200 dense bf16).
4. **Chunked prefill.** The 8B shape again: p99 inter-token latency of running decodes while long
   prompts arrive, unchunked over chunked (``benchmarks/chunked_prefill.measure_itl``).
5. **Tensor parallelism** (2+ GPUs; skipped, and said so, on one): the tiny Llama at TP=2 over
   NCCL (rank r on cuda:r), greedy tokens against TP=1 on the same checkpoint, and rank 0's CUDA
   IPC view of rank 1's KV cache byte-equal to what rank 1 holds (what the KV transfer ships from).

It needs only torch, triton and transformers (plus numpy, safetensors, xxhash, tqdm, which come
with them): no msgspec, redis, ucxx, gguf or network. A step that fails is reported under
``errors`` and the next one still runs. The last line of stdout is one JSON object (fields: README,
"GPU check").
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HBM_BYTES_PER_S = 4.8e12  # H200
PEAK_BF16_FLOPS = 989e12  # H200 dense bf16
BF16_TOLERANCE = 2e-2  # max abs error of a bf16 backend against the fp32 torch path (outputs ~ 1)
FP32_TOLERANCE = 1e-3  # issue 13: under the interpreter, each case within 1e-3 of the torch path

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384, rope_theta=500000.0,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
LLAMA_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- 1. attention ---------------------------------------------------------------------------


def check_attention(device, dtype, cases, tolerance: float) -> dict:
    """Every case on every backend that can run it; the worst error and whether all passed."""
    from common.engine.attention.interface import FLASH_PAGED_BLOCK_MULTIPLE
    from common.engine.attention.selection import flash_attn_installed
    from common.engine.attention.check import run_case

    backends = ["triton"] + (["flash"] if device.type == "cuda" and flash_attn_installed() else [])
    errors, failed = {}, []
    for backend in backends:
        for case in cases:
            if backend == "flash" and case.block_size % FLASH_PAGED_BLOCK_MULTIPLE:
                continue  # flash-attn cannot page it; make_attention picks Triton there
            result = run_case(case, backend, device, dtype)
            name = f"{backend}/{case.name}"
            errors[name] = result.max_abs_err
            if not (result.cache_matches and result.max_abs_err < tolerance):
                failed.append(name)
            log(f"attention {name}: max abs err {result.max_abs_err:.2e}, cache {'ok' if result.cache_matches else 'WRONG'}")
    return {
        "attention_backends": backends,
        "attention_cases": len(errors),
        "attention_max_abs_err": max(errors.values()),
        "attention_tolerance": tolerance,
        "attention_ok": not failed,
        "attention_failed": failed,
        "attention_errors": {name: float(f"{err:.3g}") for name, err in errors.items()},
    }


# ---- 2. greedy parity -------------------------------------------------------------------------


def check_parity(device, workdir: Path, smoke: bool) -> dict:
    """Our greedy tokens against transformers' generate(), fp32, request by request (unpadded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_util import random_prompts, write_random_llama
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    checkpoint = write_random_llama(workdir / "parity-llama-tiny", "tiny")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, for transformers and for us
    rng = random.Random(0)
    lengths = [5, 40] if smoke else [5, 33, 97, 300, 611, 1000]
    max_tokens = 4 if smoke else 24
    prompts = random_prompts(rng, lengths, 4096)
    reference_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    reference = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference_model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                                           min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
        reference.append(out[0, len(prompt):].tolist())
    del reference_model

    runs = {}
    backend = "triton" if device.type == "cuda" else "torch"
    for mode, extra in parity_modes(device):
        engine = Engine(EngineConfig(model=str(checkpoint), device=device.type, dtype="float32",
                                     attention_backend=backend, num_blocks=512, block_size=16,
                                     max_num_batched_tokens=32 if smoke else 256, max_num_seqs=8, **extra),
                        load_tokenizer=False)
        outputs = [r.token_ids for r in engine.generate(prompts, {"temperature": 0, "ignore_eos": True,
                                                                   "max_tokens": max_tokens})]
        runs[f"{backend}_{mode}"] = outputs == reference
        mismatched = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
        log(f"parity {backend}_{mode}: {'equal' if not mismatched else f'requests {mismatched} differ'}")
        del engine
        free_memory()
    return {"greedy_parity": all(runs.values()), "greedy_parity_runs": runs,
            "greedy_tokens_compared": len(prompts) * max_tokens}


def parity_modes(device) -> list[tuple[str, dict]]:
    """With and without CUDA graphs on a GPU (decode-only steps replayed, padded to their bucket)."""
    if device.type == "cuda":
        return [("cuda_graphs", {"cuda_graphs": True}), ("eager", {"cuda_graphs": False})]
    return [("eager", {})]


# ---- 3. decode step time and prefill MFU --------------------------------------------------------


def write_config(directory: Path, shape: dict) -> Path:
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape).save_pretrained(directory)
    return directory


def make_engine(checkpoint: Path, device, **overrides):
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    free_memory()  # an engine of a step that failed may just have been let go
    settings = dict(model=str(checkpoint), load_format="dummy", device=device.type,
                    dtype="bfloat16" if device.type == "cuda" else "float32", kv_memory_fraction=0.4,
                    num_blocks=None if device.type == "cuda" else 256,
                    enable_prefix_caching=False, max_num_seqs=128, max_num_batched_tokens=8192)
    settings.update(overrides)
    return Engine(EngineConfig(**settings), load_tokenizer=False)


def free_memory() -> None:
    """Give the memory of engines no longer referenced back to the device (the next engine sizes
    its KV cache from what is free)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_bytes(model) -> int:
    """Bytes of the weights one decode step reads: all of them but the embedding table (each token
    reads one row of it), unless the table is also the output projection."""
    tied = model.cfg.tie_word_embeddings
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if tied or "embed_tokens" not in name)


def matmul_params(model) -> int:
    """Weights in the decoder layers' matrix multiplies (FLOPs per token = 2 x this, plus attention)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2)


def decode_step_ms(engine, batch: int, steps: int, prompt_len: int = 128, warmup: int = 3) -> float:
    """Median wall time of an engine step in which ``batch`` requests each decode one token."""
    from benchmarks.bench_util import random_prompts

    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    # Room for the steps that compute the other prompts while the first ones already decode.
    params = {"temperature": 0, "ignore_eos": True, "max_tokens": warmup + steps + 64}
    ids = [engine.add_request(p, params) for p in random_prompts(rng, [prompt_len] * batch, vocab)]
    started: set[str] = set()
    while len(started) < batch:  # prompts (a step or two), then every request decodes
        started.update(o.request_id for o in engine.step())
    times = []
    for i in range(warmup + steps):
        began = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - began
        assert len(outputs) == batch, f"a decode step of {batch} requests returned {len(outputs)} tokens"
        if i >= warmup:
            times.append(elapsed)
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times) * 1e3


def prefill_step(engine, device, num_prompts: int, prompt_len: int, repeats: int) -> tuple[float, int]:
    """Median wall time of a step that computes ``num_prompts`` whole prompts; the tokens per step."""
    from benchmarks.bench_util import random_prompts

    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    times = []
    for i in range(repeats + 1):  # the first one warms up (Triton compiles the prefill launch)
        for prompt in random_prompts(rng, [prompt_len] * num_prompts, vocab):
            engine.add_request(prompt, {"temperature": 0, "max_tokens": 1, "ignore_eos": True})
        synchronize(device)
        began = time.perf_counter()
        outputs = engine.step()
        synchronize(device)
        elapsed = time.perf_counter() - began
        assert len(outputs) == num_prompts and all(o.finished for o in outputs), "the prompts did not fit one step"
        if i:
            times.append(elapsed)
    return statistics.median(times), num_prompts * prompt_len


def check_speed(device, workdir: Path, smoke: bool) -> dict:
    shape = LLAMA_TINY if smoke else LLAMA_8B
    checkpoint = write_config(workdir / ("llama-tiny-dummy" if smoke else "llama-8b-dummy"), shape)
    batches = (1, 4) if smoke else (1, 32, 128)
    steps = 2 if smoke else 30
    engine = make_engine(checkpoint, device, max_num_seqs=max(batches), max_num_batched_tokens=256 if smoke else 8192)
    model, mc = engine.model, engine.model_config
    weight_bytes = decode_bytes(model)
    roofline_ms = weight_bytes / HBM_BYTES_PER_S * 1e3
    log(f"speed: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
        f"{weight_bytes / 1e9:.2f} GB read per decode step, roofline {roofline_ms:.3f} ms; attention "
        f"{engine.attention.name}")
    step_ms = {}
    for batch in batches:
        step_ms[str(batch)] = round(decode_step_ms(engine, batch, steps), 3)
        log(f"decode batch {batch}: {step_ms[str(batch)]} ms per step")
    result = {
        "speed_model": "llama-tiny-dummy" if smoke else "llama-3-8b-shape-dummy",
        "speed_attention_backend": engine.attention.name,
        "cuda_graphs": engine.runner.graphs is not None,
        "decode_weight_bytes": weight_bytes,
        "decode_roofline_ms": round(roofline_ms, 3),
        "decode_step_ms": step_ms,
        "decode_tokens_per_s": {b: round(int(b) / ms * 1e3, 1) for b, ms in step_ms.items()},
        "decode_b1_over_roofline": round(step_ms["1"] / roofline_ms, 3),
    }
    result.update(eager_decode(engine, steps))

    num_prompts, prompt_len = (2, 32) if smoke else (4, 2048)
    seconds, tokens = prefill_step(engine, device, num_prompts, prompt_len, repeats=1 if smoke else 3)
    linear = 2 * matmul_params(model) * tokens
    # QK^T and PV: 2 FLOPs x 2 matmuls x heads x head_dim per (query, visible key) pair, causal.
    attention = 4 * mc.num_heads * mc.head_dim * mc.num_layers * num_prompts * prompt_len * (prompt_len + 1) // 2
    flops = linear + attention
    result.update({
        "prefill_tokens_per_step": tokens,
        "prefill_step_ms": round(seconds * 1e3, 3),
        "prefill_tflops": round(flops / seconds / 1e12, 1),
        "prefill_mfu": round(flops / seconds / PEAK_BF16_FLOPS, 4),
    })
    log(f"prefill: {tokens} tokens in {seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.0f} TFLOP/s")
    result["targets"] = {
        "decode_b1_within_1.3x_roofline": result["decode_b1_over_roofline"] <= 1.3,
        "prefill_mfu_at_least_0.5": result["prefill_mfu"] >= 0.5,
    }
    del engine, model
    free_memory()
    return result


def eager_decode(engine, steps: int) -> dict:
    """Decode at batch 1 with the CUDA graphs set aside: what they save."""
    graphs = engine.runner.graphs
    if graphs is None:
        return {}
    engine.runner.graphs = None
    try:
        ms = round(decode_step_ms(engine, 1, steps), 3)
    finally:
        engine.runner.graphs = graphs
    log(f"decode batch 1 without CUDA graphs: {ms} ms per step")
    return {"decode_step_ms_no_cuda_graphs": {"1": ms}}


# ---- 4. chunked prefill -------------------------------------------------------------------------


def check_chunked_prefill(device, workdir: Path, smoke: bool) -> dict:
    from benchmarks.chunked_prefill import measure_itl

    shape = LLAMA_TINY if smoke else LLAMA_8B
    checkpoint = write_config(workdir / ("llama-tiny-dummy" if smoke else "llama-8b-dummy"), shape)
    prompt_len, chunk = (96, 32) if smoke else (8192, 1024)
    workload = dict(num_decoders=2 if smoke else 32, num_long=1 if smoke else 3, prompt_len=prompt_len,
                    gap=2 if smoke else 16, vocab=shape["vocab_size"])
    results = {}
    for name, budget in ((f"chunked_{chunk}", chunk), ("unchunked", prompt_len + 256)):
        engine = make_engine(checkpoint, device, max_num_seqs=min(64, budget), max_num_batched_tokens=budget)
        if not smoke:
            measure_itl(engine, **{**workload, "num_long": 1, "num_decoders": 2, "gap": 2})  # warm-up (compiles)
        results[name] = measure_itl(engine, **workload)
        log(f"chunked prefill {name}: {results[name]}")
        del engine
        free_memory()
    unchunked, chunked = results["unchunked"], results[f"chunked_{chunk}"]
    return {
        "itl_prompt_len": prompt_len,
        "itl_num_decoders": workload["num_decoders"],
        "itl_p99_ms": {name: round(r["itl_p99_ms"], 2) for name, r in results.items()},
        "itl_p50_ms": {name: round(r["itl_p50_ms"], 2) for name, r in results.items()},
        "itl_p99_ratio_unchunked_over_chunked": round(unchunked["itl_p99_ms"] / chunked["itl_p99_ms"], 3),
        "itl_throughput_ratio_chunked_over_unchunked": round(chunked["tokens_per_s"] / unchunked["tokens_per_s"], 3),
    }


# ---- driver -------------------------------------------------------------------------------------


# ---- 5. tensor parallelism ----------------------------------------------------------------------

TP_PROMPTS = [[5, 17, 99, 230, 11] * 8, list(range(3, 120))]


def _tp_rank(rank: int, size: int, checkpoint: str, out: str) -> None:
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    engine = Engine(EngineConfig(model=checkpoint, device="cuda", dtype="float32", num_blocks=256, block_size=16,
                                 tensor_parallel_size=size, cuda_graphs=False), load_tokenizer=False)
    if rank:
        engine.follow()
        torch.cuda.synchronize()
        Path(f"{out}.rank{rank}").write_text(str(float(engine.kv_cache.buffer.double().sum())))
        return
    tokens = [r.token_ids for r in engine.generate(TP_PROMPTS, {"max_tokens": 16, "temperature": 0,
                                                                "ignore_eos": True})]
    engine.stop_followers()
    torch.cuda.synchronize()
    seen = [float(c.buffer.double().sum()) for c in engine.kv_shards.caches[1:]]
    Path(out).write_text(json.dumps({"tokens": tokens, "mapped_sums": seen}))


def check_tensor_parallel(device, workdir: Path) -> dict:
    """TP=2 over NCCL against TP=1 (see the module docstring); None fields on fewer than 2 GPUs."""
    import torch

    from benchmarks.bench_util import write_random_llama
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from tests.support.rank_group import run_group

    if device.type != "cuda" or torch.cuda.device_count() < 2:
        log("tp: skipped (needs 2 CUDA GPUs)")
        return {"tp2_identical": None, "tp2_kv_mapped": None}
    checkpoint = write_random_llama(workdir / "tp-llama-tiny", "tiny")
    engine = Engine(EngineConfig(model=str(checkpoint), device="cuda", dtype="float32", num_blocks=256,
                                 block_size=16), load_tokenizer=False)
    reference = [r.token_ids for r in engine.generate(TP_PROMPTS, {"max_tokens": 16, "temperature": 0,
                                                                   "ignore_eos": True})]
    del engine
    free_memory()
    out = workdir / "tp2.json"
    run_group(_tp_rank, 2, str(checkpoint), str(out), backend="nccl")
    got = json.loads(out.read_text())
    follower_sum = float(Path(f"{out}.rank1").read_text())
    return {"tp2_identical": got["tokens"] == reference,
            "tp2_kv_mapped": abs(got["mapped_sums"][0] - follower_sum) <= 1e-6 * max(1.0, abs(follower_sum))}


def environment(device) -> dict:
    import torch
    import transformers
    import triton

    from common.engine.attention.selection import flash_attn_installed

    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "flash_attn": None}
    if flash_attn_installed():
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    return info


class OutOfTime(Exception):
    pass


def _out_of_time(_signum, _frame) -> None:
    raise OutOfTime("the step ran past --time-limit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-interpret", action="store_true",
                        help="step 1 only, on CPU under Triton's interpreter (fp32, small shapes)")
    parser.add_argument("--smoke", action="store_true",
                        help="every step on tiny shapes, on whatever device there is: checks this script, "
                             "its numbers mean nothing")
    parser.add_argument("--steps", default="attention,parity,speed,chunked,tp",
                        help="comma-separated subset of attention,parity,speed,chunked,tp")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-gpu-check")
    parser.add_argument("--time-limit", type=float, default=450.0,
                        help="seconds for all steps: a step still running then is stopped and reported under "
                             "errors, later ones are skipped, and the JSON line still comes out")
    args = parser.parse_args()
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first Triton kernel is built

    import torch

    from common.engine.attention.check import GPU_CASES, SMALL_CASES

    began = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.cpu_interpret
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not (args.cpu_interpret or args.smoke):
        parser.error("no CUDA device: use --cpu-interpret (step 1 on CPU) or --smoke")
    steps = ["attention"] if args.cpu_interpret else args.steps.split(",")
    mode = "cpu-interpret" if args.cpu_interpret else ("smoke" if args.smoke else "gpu")
    result: dict = {"check": "gpu_check", "mode": mode, **environment(device)}
    errors, seconds = {}, {}
    signal.signal(signal.SIGALRM, _out_of_time)
    for step in steps:
        step_began = time.perf_counter()
        left = args.time_limit - (step_began - began)
        if left < 1:
            errors[step] = "skipped: out of time (--time-limit)"
            continue
        signal.setitimer(signal.ITIMER_REAL, left)
        try:
            if step == "attention":
                if device.type == "cuda":
                    result.update(check_attention(device, torch.bfloat16, GPU_CASES, BF16_TOLERANCE))
                elif args.cpu_interpret or os.environ.get("TRITON_INTERPRET") == "1":
                    result.update(check_attention(device, torch.float32, SMALL_CASES, FP32_TOLERANCE))
                else:
                    log("attention: skipped (no CUDA device and no --cpu-interpret)")
            elif step == "parity":
                result.update(check_parity(device, args.workdir, args.smoke))
            elif step == "speed":
                result.update(check_speed(device, args.workdir, args.smoke))
            elif step == "chunked":
                result.update(check_chunked_prefill(device, args.workdir, args.smoke))
            elif step == "tp":
                result.update(check_tensor_parallel(device, args.workdir))
            else:
                raise ValueError(f"unknown step {step!r}")
        except Exception as exc:  # report it and go on: one GPU run should tell as much as it can
            traceback.print_exc()
            errors[step] = f"{type(exc).__name__}: {exc}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        seconds[step] = round(time.perf_counter() - step_began, 1)
        log(f"{step}: {seconds[step]} s")
    result.update({"step_seconds": seconds, "total_seconds": round(time.perf_counter() - began, 1),
                   "errors": errors, "ok": not errors and result.get("attention_ok", True)
                   and result.get("greedy_parity", True)})
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
