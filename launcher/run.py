"""``python -m launcher`` (what ``make up`` runs): start the local stack, keep it running, stop it on
Ctrl-C.  ``run_stack`` is that life cycle, for the tests to drive with their own stack."""
from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path
from typing import Callable, Mapping

from common.cluster.children import StopSignals
from common.cluster.flags import EnvFlags, FlagParser
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX
from common.engine.config import EngineConfig
from kvtransfer.config import default_transport
from launcher.local_stack import LocalStack, StartCancelled, gateway_health, local_secret
from launcher.supervisor import Supervisor


def run_stack(stack: LocalStack, redis_server, signals: StopSignals, start: Callable[[], object],
              make_supervisor: Callable[[], Supervisor]) -> Supervisor:
    """What ``make up`` does with a stack: ``start()`` it (which should raise ``StartCancelled`` once
    ``signals.requested``), supervise it until a stop signal (or until the supervisor gives up the
    gateway or Redis), and on every path stop every process of the stack, then the private Redis
    (``redis_server``, may be None); at once when ``signals.hurry``.  Returns the supervisor."""
    try:
        start()
        supervisor = make_supervisor()
        supervisor.run(lambda: signals.requested)
        return supervisor
    finally:
        print("stopping...", flush=True)
        stack.stop(hurry=lambda: signals.hurry)
        if redis_server is not None:
            if signals.hurry:
                redis_server.kill()
            redis_server.stop()


def build_parser(env=None) -> FlagParser:
    """``python -m launcher``'s flags (each also read from ``PDSERVE_<FLAG>`` in ``env``)."""
    parser = FlagParser(
        description="Run gateway + prefill + decode workers locally and keep them running (make up). "
                    "Every flag also reads PDSERVE_<FLAG>; the processes it starts read theirs too.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags = EnvFlags(parser, env, aliases={"port": ("PDSERVE_GATEWAY_PORT",)})
    flags.add("--model", "default")
    flags.add("--port", 8000, int, help="the gateway's port (also PDSERVE_GATEWAY_PORT)")
    flags.add("--prefill", 1, int, help="prefill workers")
    flags.add("--decode", 1, int, help="decode workers")
    flags.add("--kv-transport", default_transport(), choices=("ucx", "tcp"))
    flags.add("--num-blocks", 2048, int, help="KV blocks per worker")
    flags.add("--key-prefix", DEFAULT_KEY_PREFIX, help="Redis key prefix of this stack's registry and prefix index")
    flags.add("--restart-backoff", 1.0, float,
              help="seconds before a process that exited is started again (doubles while it keeps exiting soon "
                   "after starting, up to 30 s)")
    flags.add("--crash-loop-limit", 10, int,
              help="a process that exits this many times in a row within 60 s of starting is not started again "
                   "(a worker: the rest keep serving; the gateway or the private Redis: the launcher stops, exit 1)")
    return parser


def stack_from_args(args, redis_url: str, cluster_secret: str | None = None) -> LocalStack:
    """The stack ``make up`` runs for these flags: CPU workers share this host's cores, so they take
    turns on them (``--core-turns``, a lock file per stack in the cache directory)."""
    turns = ["--core-turns", str(core_turns_path(args.key_prefix))] if workers_compute_on_cpu() else []
    return LocalStack(args.model, redis_url, key_prefix=args.key_prefix, prefill=args.prefill, decode=args.decode,
                      transport=args.kv_transport, gateway_port=args.port,
                      worker_args=["--num-blocks", str(args.num_blocks), *turns], cluster_secret=cluster_secret)


def workers_compute_on_cpu() -> bool:
    """Whether the workers will compute on the CPU: their device (PDSERVE_DEVICE) is ``cpu``, or
    ``auto`` on a host without an NVIDIA driver."""
    device = os.environ.get("PDSERVE_DEVICE", EngineConfig.device)
    return device == "cpu" or (device == "auto" and not Path("/dev/nvidiactl").exists())


def core_turns_path(key_prefix: str) -> Path:
    """The lock file the workers of the stack with ``key_prefix`` take turns on: in the user's own
    cache directory (in a shared /tmp another user could hold it)."""
    from common.engine.loading.default_model import default_cache_dir

    return default_cache_dir() / "run" / f"core-turns-{hashlib.sha256(key_prefix.encode()).hexdigest()[:12]}.lock"


def curl_key_header(env: Mapping[str, str]) -> str:
    """The curl example's key header: the gateway's key by name (never its value), a placeholder
    where only a keys file holds the keys, nothing where the gateway takes none."""
    if env.get("PDSERVE_API_KEY"):
        return ' -H "Authorization: Bearer $PDSERVE_API_KEY"'  # (double quotes: the shell puts the key in)
    if env.get("PDSERVE_API_KEYS_FILE"):
        return " -H 'Authorization: Bearer <a key from your PDSERVE_API_KEYS_FILE>'"
    return ""


def main() -> None:
    from common.cluster.redis_util import ensure_redis, redact_url, redis_url_from_env

    args = build_parser().parse_args()

    if args.model == "default":
        from common.engine.loading.default_model import ensure_default_model

        print("preparing the default model (Gemma 3 270M; converted once, then cached)...", flush=True)
        ensure_default_model()
    secret = local_secret(os.environ)
    signals = StopSignals().install()  # from here on a signal never interrupts: start-up checks for it
    url, redis_server = ensure_redis(redis_url_from_env())
    if redis_server is not None:
        print(f"no Redis answered at {redact_url(redis_url_from_env())}; started a private one at {url}", flush=True)
    stack = stack_from_args(args, url, secret)

    def start() -> None:
        stack.start(timeout=600, cancelled=lambda: signals.requested)
        model = gateway_health(stack.gateway_url)["model"]  # (/health answers without the API key)
        key = curl_key_header(os.environ)
        print(f"""
pdserve is up: {stack.gateway_url}  (model {model}; {args.prefill} prefill + {args.decode} decode, KV over {args.kv_transport})

  curl {stack.gateway_url}/v1/completions -H 'Content-Type: application/json'{key} \\
       -d '{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16, "stream": true}}'

A process that stops is restarted; Ctrl-C stops everything (drained; Ctrl-C three times: at once).""", flush=True)

    def new_supervisor() -> Supervisor:
        return Supervisor(stack, redis_server, min_backoff=args.restart_backoff,
                          max_backoff=max(30.0, args.restart_backoff), crash_loop_limit=args.crash_loop_limit)

    try:
        supervisor = run_stack(stack, redis_server, signals, start, new_supervisor)
    except StartCancelled as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    if supervisor.failed:
        raise SystemExit(f"stopped: {', '.join(sorted(supervisor.given_up))} kept crashing")

