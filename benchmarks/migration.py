"""Stream migration: how long a moved stream pauses, a live KV move (drain) against a replay (kill).

A real stack -- a private Redis, one prefill and two decode workers, the gateway -- serves
``--model`` (as ``benchmarks/serving.py`` takes it: ``tiny`` or ``100m``, random Llamas with a
word-level tokenizer, ``default`` or a checkpoint path).  ``--streams`` greedy streams of
``--prompt-tokens`` random tokens each (``ignore_eos``, ``--max-tokens``) all start on decode
worker d0 (d1 is out of the decode pool while they start, and back before the move), then:

    reference  both modes' streams, nothing moves: their answers, and the inter-token latency
    live       d0 drains (the gateway's admin API): d1 pre-copies each stream's KV -- prompt and
               output so far -- from d0's cache over kvtransfer while it decodes on, then every
               stream is handed over at a token boundary and d1 fetches the rest
    replay     other prompts; d0 is SIGKILLed: every stream moves to d1, which computes prompt and
               output again (d1 has never seen them: no prefix-cache hit flatters the replay)

Reported per mode: the gateway's ``pdserve_migration_gap_seconds`` (a move's last token to the
next one, mean), each stream's longest pause between two chunks as its client saw it (p50, p90),
and whether every answer equals the reference.  The reference for the gaps is the inter-token
latency measured in the same run (``itl_p50_s``).  The last line is one JSON object.

    python -m benchmarks.migration [--quick]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import uuid
from pathlib import Path

import openai

from benchmarks import chaos_checks
from benchmarks.bench_util import emit, percentile
from benchmarks.serving import prepare_model
from common.cluster.redis_util import RedisServer
from launcher.local_stack import LocalStack, http_json

ADMIN_TOKEN = "pdserve-migration-bench-admin-token"
DECODERS = ("d0", "d1")


def gateway_metric(stack: LocalStack, name: str) -> float:
    return chaos_checks.gateway_metric(stack.gateway_url, name)


def admin(stack: LocalStack, worker: str, action: str, body: bytes = b"{}") -> None:
    http_json(f"{stack.gateway_url}/admin/workers/{worker}/{action}", "POST", body, {"X-Admin-Token": ADMIN_TOKEN})


def wait_for(condition, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:g} s")
        time.sleep(0.05)


def decoders_routed(stack: LocalStack) -> int:
    return http_json(f"{stack.gateway_url}/health")["pools"]["decode"]["healthy"]


class Stream(threading.Thread):
    """One streamed completion, read in the background: its tokens' text and arrival times."""

    def __init__(self, stack: LocalStack, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=600)
        self.model, self.prompt, self.max_tokens = stack.model_name, prompt, max_tokens
        self.text, self.times, self.error = [], [], None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(model=self.model, prompt=self.prompt, stream=True,
                                                        max_tokens=self.max_tokens, temperature=0,
                                                        extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    self.text.append(chunk.choices[0].text)
                    self.times.append(time.monotonic())
                    self.started.set()
        except Exception as exc:  # reported in the result
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def run_streams(stack: LocalStack, prompts: list[list[int]], max_tokens: int, move=None) -> list[Stream]:
    """The streams, all started on d0; ``move(stack)`` once every one has its first token."""
    admin(stack, "d1", "role", b'{"role": "prefill"}')
    wait_for(lambda: decoders_routed(stack) == 1, "gateway routing to d0 alone")
    streams = [Stream(stack, prompt, max_tokens) for prompt in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.started.wait(600)
    admin(stack, "d1", "role", b'{"role": "decode"}')
    wait_for(lambda: decoders_routed(stack) == 2, "gateway routing to d1 again")
    if move is not None:
        move(stack)
    for stream in streams:
        stream.join(600)
    return streams


def measure(stack: LocalStack, mode: str, prompts, max_tokens: int, reference: list[str] | None = None) -> dict:
    gap_sum, gap_count = (gateway_metric(stack, f"pdserve_migration_gap_seconds_{s}") for s in ("sum", "count"))
    moved_before = stack.stats("d0").get("moved_blocks", 0) if mode == "live" else 0
    precopied_before, held_before = (gateway_metric(stack, name) for name in (
        'pdserve_migration_precopies_total{outcome="ok"}', "pdserve_migration_held_tokens_total"))

    def drain(s: LocalStack) -> None:
        admin(s, "d0", "drain")

    streams = run_streams(stack, prompts, max_tokens, {"live": drain, "replay": lambda s: s.kill("d0")}.get(mode))
    errors = [s.error for s in streams if s.error]
    texts = ["".join(s.text) for s in streams]
    result = {"errors": errors[:3]}
    if reference is None:
        result.update(texts=texts, itl_p50_s=percentile([g for s in streams for g in s.gaps], 50))
        return result
    moves = gateway_metric(stack, "pdserve_migration_gap_seconds_count") - gap_count
    longest = [max(s.gaps) for s in streams if s.gaps]
    result.update(
        identical=texts == reference, moves=int(moves),
        gateway_gap_mean_s=(gateway_metric(stack, "pdserve_migration_gap_seconds_sum") - gap_sum) / moves
        if moves else None,
        client_pause_p50_s=percentile(longest, 50), client_pause_p90_s=percentile(longest, 90))
    if mode == "live":
        result["moved_blocks"] = stack.stats("d0")["moved_blocks"] - moved_before
        result["precopies"] = int(gateway_metric(stack, 'pdserve_migration_precopies_total{outcome="ok"}')
                                  - precopied_before)
        # tokens whose KV the new worker already held when each stream arrived (its pre-copy)
        result["held_tokens_per_move"] = ((gateway_metric(stack, "pdserve_migration_held_tokens_total") - held_before)
                                          / moves if moves else None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--model", default="tiny", help="tiny, 100m, default, or a checkpoint path")
    parser.add_argument("--quick", action="store_true", help="4 streams of 500 prompt tokens")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.prompt_tokens, args.max_tokens = 4, 500, 400
    rng = random.Random(0)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-migration-"))
    checkpoint, vocab = prepare_model(args.model)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(2 * args.streams)]
    live_prompts, replay_prompts = prompts[:args.streams], prompts[args.streams:]
    redis = RedisServer().start()
    blocks = 3 * args.streams * (args.prompt_tokens + args.max_tokens) // 16 + 64
    stack = LocalStack(str(checkpoint), redis.url, key_prefix=f"migration-{uuid.uuid4().hex[:8]}", workdir=workdir,
                       prefill=1, decode=2, worker_args=["--num-blocks", str(blocks), "--block-size", "16"],
                       gateway_args=["--skip-prefill-below", "32", "--queue-timeout", "60"],
                       extra_env={"PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        stack.start(timeout=600)
        reference = measure(stack, "reference", prompts, args.max_tokens)
        texts = reference["texts"]
        live = measure(stack, "live", live_prompts, args.max_tokens, texts[:args.streams])
        admin(stack, "d0", "role", b'{"role": "decode"}')
        replay = measure(stack, "replay", replay_prompts, args.max_tokens, texts[args.streams:])
    finally:
        stack.stop()
        redis.stop()
    itl = reference["itl_p50_s"]
    emit({"benchmark": "migration", "streams": args.streams, "prompt_tokens": args.prompt_tokens,
          "max_tokens": args.max_tokens, "model": args.model, "itl_p50_s": itl,
          "live": live, "replay": replay,
          "live_gap_over_replay_gap": (live["gateway_gap_mean_s"] / replay["gateway_gap_mean_s"]
                                       if live.get("gateway_gap_mean_s") and replay.get("gateway_gap_mean_s") else None),
          "greedy_identical": bool(live.get("identical") and replay.get("identical")),
          "reference_errors": reference["errors"]})


if __name__ == "__main__":
    main()
