"""A worker's configuration, from command-line flags and ``PDSERVE_<FLAG>`` environment variables."""
from __future__ import annotations

import argparse
import socket
import uuid
from dataclasses import dataclass, field
from typing import Mapping

from common.engine.structured.backend import BACKENDS
from common.cluster.auth import AuthError, ClusterAuth, configure_auth, read_secret
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX
from common.engine.models.quantization_scheme import INT4_GROUP_SIZES, QUANTIZATIONS
from common.engine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig, describe_default
from common.engine.speculative.speculation import METHODS as SPECULATIVE_METHODS
from common.cluster.http_limits import HttpLimits, add_http_flags, http_limits_from_args
from common.cluster.flags import EnvFlags, FlagParser, RecordsCommandLine, RemovedFlag, given_on_command_line
from common.cluster.redis_util import (
    DEFAULT_REDIS_URL, redact_url, redis_url_with_password_file, warn_password_on_command_line,
)
from kvtransfer.config import KV_DEFAULTS, KVTransferConfig, default_transport

ROLES = ("prefill", "decode", "both")
MAX_STEP_FAILURES = 3  # engine steps that may fail in a row before the engine fails
# The first step of each kind may take this many times the watchdog's bound (worker.engine_thread).
FIRST_STEP_ALLOWANCE = 4.0


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs; validated on construction."""

    engine: EngineConfig
    kv: KVTransferConfig
    role: str = "both"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    host: str = "127.0.0.1"  # HTTP bind address
    port: int = 0
    advertise_host: str | None = None  # the address peers use (another host, a container name)
    redis_url: str = field(default=DEFAULT_REDIS_URL, repr=False)  # may hold the Redis password
    key_prefix: str = DEFAULT_KEY_PREFIX
    heartbeat_ttl_s: float = 5.0
    max_pending_requests: int = 256  # beyond this, new requests get "busy"
    # Calls this worker makes to other workers: connecting (also waiting for a pooled connection),
    # and the whole of a control call (/abort).  A remote prefill is bounded by kv.transfer_timeout.
    peer_connect_timeout_s: float = 5.0
    control_timeout_s: float = 5.0
    # Engine steps that may fail in a row (their requests get errors) before the worker gives up:
    # it leaves the pool and exits non-zero so its supervisor restarts it.
    max_step_failures: int = MAX_STEP_FAILURES
    # The most one engine step or engine call may take (the first step of each kind, prefill-sized
    # or decode-only, FIRST_STEP_ALLOWANCE times that) before the worker counts its engine as hung
    # and fails the same way (0: no bound).  Generous: a long prompt chunk of a big model on CPU, or
    # a kernel compiled on first use, must never trip it.
    engine_watchdog_s: float = 300.0
    # On SIGTERM, seconds to let in-flight requests finish before stopping (--drain-timeout).
    drain_timeout_s: float = 30.0
    # After the engine failed, seconds to let in-flight requests get their error before exiting.
    failure_drain_timeout_s: float = 5.0
    # PDSERVE_CLUSTER_SECRET (or --cluster-secret-file): required unless every listener is on
    # loopback; never printed.
    cluster_secret: str | None = field(default=None, repr=False)
    http: HttpLimits = field(default_factory=HttpLimits)  # the HTTP port's connection limits
    # A lock file that the workers sharing this host's cores take turns on, a step at a time
    # (common.engine.core_turns); None: steps run whenever they are ready.
    core_turns: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"invalid config: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"invalid config: port must be in 0..65535, got {self.port}")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"invalid config: heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        if self.max_step_failures < 1:
            raise ValueError(f"invalid config: max_step_failures must be >= 1, got {self.max_step_failures}")
        if not self.engine_watchdog_s >= 0:
            raise ValueError(f"invalid config: engine_watchdog_s must be >= 0 seconds (0: off), got {self.engine_watchdog_s}")
        for name in ("drain_timeout_s", "failure_drain_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"invalid config: {name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.max_pending_requests < 1:
            raise ValueError(f"invalid config: max_pending_requests must be >= 1, got {self.max_pending_requests}")
        for name in ("peer_connect_timeout_s", "control_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"invalid config: {name} must be > 0 seconds, got {getattr(self, name)}")
        self.auth()  # a weak secret, or none with an exposed listener, is refused at start-up

    def auth(self) -> ClusterAuth:
        """The cluster auth this worker signs and checks with; raises ValueError naming the problem."""
        try:
            return configure_auth(self.cluster_secret, [self.host, self.kv.host], "this worker")
        except AuthError as exc:
            raise ValueError(f"invalid config: {exc}") from None

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host


# flag dest -> older variable names still honoured
ENV_ALIASES: dict[str, tuple[str, ...]] = {"redis_url": ("REDIS_URL",)}


def build_parser(default_role: str, description: str, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags shared by ``python -m prefill_svc`` and ``python -m decode_svc``.  Every flag also
    reads ``PDSERVE_<FLAG>`` (e.g. ``PDSERVE_MODEL``, ``PDSERVE_KV_TRANSPORT``; ``REDIS_URL`` is an
    alias of ``PDSERVE_REDIS_URL``); see ``common.cluster.flags``."""
    p = FlagParser(description=f"{description} Every flag also reads PDSERVE_<FLAG> "
                               "(e.g. PDSERVE_NUM_BLOCKS).",
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags = EnvFlags(p, env, ENV_ALIASES)
    add = flags.add
    add("--model", "default", help="HF checkpoint directory, .gguf file, or 'default'")
    add("--role", default_role, choices=ROLES)
    add("--worker-id", help="unique id (default: hostname + random suffix)")
    add("--host", WorkerConfig.host, help="HTTP bind address")
    add("--port", WorkerConfig.port, int, help="HTTP port (0: any free port)")
    add("--advertise-host", help="address other hosts use to reach this worker")
    add("--kv-transport", default_transport(), choices=("ucx", "tcp"))
    add("--kv-host", help="KV listen address (default: --host)")
    add("--kv-port", 0, int)
    add("--kv-timeout", KV_DEFAULTS.transfer_timeout, float,
        help="seconds a remote prefill may take, queueing on the prefill worker included: bounds both the "
             "/prefill call and the KV transfer (a dead peer is noticed at once through its connections; "
             "this bounds a hung one, after which the decode worker computes the prompt itself)")
    add("--kv-connect-timeout", KV_DEFAULTS.connect_timeout, float, help="seconds to connect to a peer's KV port and complete the handshake")
    add("--kv-lease-timeout", KV_DEFAULTS.lease_timeout, float,
        help="seconds a prefill worker waits for the decode worker's acknowledgement of a transfer")
    add("--kv-abort-grace", KV_DEFAULTS.abort_grace, float,
        help="seconds an aborted transfer's payload may keep landing (UCX) before its connection is closed")
    flags.add_switch("--kv-checksum", help="per-block checksums on KV transfers")
    add("--kv-max-handshakes", KV_DEFAULTS.max_handshakes, int,
        help="KV connections held that have not authenticated yet; beyond, the oldest of them is closed")
    add_http_flags(add, prefix="http-")
    add("--peer-connect-timeout", WorkerConfig.peer_connect_timeout_s, float, help="seconds to connect to another worker's HTTP API")
    add("--control-timeout", WorkerConfig.control_timeout_s, float, help="seconds for a control call to another worker (abort)")
    add("--redis-url", DEFAULT_REDIS_URL, show=redact_url, action=RecordsCommandLine,
        help="Redis (a password in it is never shown; better: --redis-password-file)")
    add("--redis-password-file", help="file holding the Redis password (spliced into --redis-url)")
    add("--key-prefix", WorkerConfig.key_prefix)
    p.add_argument("--admin-token", action=RemovedFlag,
                   why="workers take admin calls signed with the cluster secret; the admin token is the gateway's alone")
    add("--heartbeat-ttl", WorkerConfig.heartbeat_ttl_s, float)
    add("--cluster-secret-file",
        help="file holding the cluster secret (default: PDSERVE_CLUSTER_SECRET); required unless --host and "
             "--kv-host are loopback addresses")
    add("--device", EngineConfig.device)
    add("--dtype", EngineConfig.dtype, choices=DTYPES, help="the model's: auto is float32 on CPU, bfloat16 on CUDA")
    add("--kv-cache-dtype", EngineConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
        help="the KV cache's (auto: the model's); bfloat16 under a float32 model holds twice the tokens and reads "
             "half the bytes a decode step, fp8 (e4m3, unscaled; the CPU attention or torch's) four times the "
             "tokens of an fp32 cache, twice a bf16 one's. Prefill and decode workers exchanging KV must agree on it")
    add("--block-size", EngineConfig.block_size, int)
    add("--num-blocks", EngineConfig.num_blocks, int)
    add("--kv-memory-fraction", EngineConfig.kv_memory_fraction, float)
    add("--max-num-batched-tokens", EngineConfig.max_num_batched_tokens, int,
        help=f"tokens computed per step (default: {describe_default('max_num_batched_tokens')})")
    add("--max-num-seqs", EngineConfig.max_num_seqs, int,
        help=f"requests in the running batch (default: {describe_default('max_num_seqs')})")
    add("--max-model-len", None, int)
    add("--remote-kv-budget", EngineConfig.remote_kv_budget, float,
        help="fraction of the KV blocks that reservations for remote prefills may hold together (one is always "
             "allowed); beyond it the decode worker answers busy")
    add("--max-step-failures", WorkerConfig.max_step_failures, int,
        help="engine steps that may fail in a row (their requests get an error) before the worker gives up, "
             "leaves the pool and exits non-zero")
    add("--engine-watchdog", WorkerConfig.engine_watchdog_s, float,
        help=f"seconds one engine step or engine call may run (the first step of each kind, prefill-sized or "
             f"decode-only, {FIRST_STEP_ALLOWANCE:g}x) before the engine counts as hung: the worker then fails as for "
             f"repeated step failures (0: no bound)")
    add("--failure-drain-timeout", WorkerConfig.failure_drain_timeout_s, float,
        help="after the engine failed, seconds to let in-flight requests get their error before exiting")
    add("--core-turns",
        help="lock file that the workers sharing this host's CPU cores take turns on: each engine step then runs "
             "alone on every core instead of beside another worker's (make up sets it for its CPU workers)")
    add("--model-id", help="model name served to clients")
    add("--attention-backend", EngineConfig.attention_backend, choices=("auto", "cpu", "torch", "flash", "triton"),
        help="auto: flash-attn on CUDA where it pages the block size (multiples of 256), else Triton; on CPU the "
             "C kernel that reads the paged cache in place (cpu) where a C compiler builds it, else torch")
    flags.add_switch("--cuda-graphs", default=EngineConfig.cuda_graphs,
                     help="replay decode-only steps from CUDA graphs captured per batch-size bucket at start-up "
                          "(CUDA with the triton or flash backend; no effect elsewhere)")
    flags.add_switch("--compile", default=True,
                     help="compile the decoder layers' work around attention with torch.compile (inductor) at "
                          "start-up, for prefill-sized steps (CPU; eager where it fails, and on CUDA, where CUDA "
                          "graphs serve decode)")
    add("--tensor-parallel-size", EngineConfig.tensor_parallel_size, int,
        help="processes (ranks) this worker runs the model on, each with its share of every layer "
             "(gloo on CPU, NCCL on GPU); pools of different sizes exchange KV")
    add("--quantization", EngineConfig.quantization, choices=QUANTIZATIONS,
        help="quantized weights for the projections, LM head and embedding: int8 (per channel) and int4 "
             "(groups; the head int8) on CPU -- on AVX512-VNNI CPUs their products also round the activations "
             "to int8 per group of inputs --, fp8 (per channel, torch._scaled_mm) on GPU")
    add("--quantization-group-size", EngineConfig.quantization_group_size, int, choices=INT4_GROUP_SIZES,
        help="int4: inputs per group sharing a scale and zero point")
    add("--speculative", EngineConfig.speculative, choices=SPECULATIVE_METHODS,
        help="speculative decoding on decode workers: ngram proposes the tokens that followed the latest earlier "
             "occurrence of a request's last tokens (prompt lookup), draft a smaller model's greedy tokens "
             "(--draft-model); one step verifies them (greedy output unchanged)")
    add("--draft-model", EngineConfig.draft_model,
        help="speculative draft: a smaller checkpoint (or .gguf) with the same tokenizer, run greedily on the decode "
             "worker to propose the tokens")
    add("--draft-quantization", EngineConfig.draft_quantization, choices=QUANTIZATIONS,
        help="speculative draft: how the draft model's weights are stored (as --quantization); the served model "
             "itself quantized (--draft-model set to it, int8 or int4) drafts most of its own tokens")
    add("--draft-vocab-size", EngineConfig.draft_vocab_size, int,
        help="speculative draft: the draft's head scores this many of its tokenizer's most common tokens and each "
             "request's own (0: every token); the head is most of a draft step's reads")
    add("--num-speculative-tokens", EngineConfig.num_speculative_tokens, int, help="draft tokens per request per step")
    add("--ngram-min", EngineConfig.ngram_min, int, help="ngram: the shortest suffix that may match")
    add("--ngram-max", EngineConfig.ngram_max, int, help="ngram: the longest suffix, tried first")
    add("--ngram-lookup-window", EngineConfig.ngram_lookup_window, int,
        help="ngram: tokens searched, back from the end of the request")
    add("--speculative-min-accepted", EngineConfig.speculative_min_accepted, float,
        help="drafts accepted per verification (moving average) below which a request decodes plainly for a while")
    add("--speculative-disable-batch-size", EngineConfig.speculative_disable_batch_size, int,
        help="no speculation while more requests than this decode (0: at any batch size)")
    flags.add_switch("--speculative-cost-gate", default=EngineConfig.speculative_cost_gate,
                     help="time decode steps with and without drafts per batch size and decode plainly for a while "
                          "where verifying makes fewer tokens per second (--no-speculative-cost-gate: always verify)")
    add("--structured-output-backend", EngineConfig.structured_output_backend, choices=BACKENDS,
        help="grammar backend for response_format, structured_outputs and tool calls (xgrammar: the "
             "'xgrammar' extra)")
    add("--grammar-compile-timeout", EngineConfig.grammar_compile_timeout_s, float,
        help="seconds a request's grammar may take to compile; then the request fails with a 400")
    add("--log-level", "INFO")
    add("--drain-timeout", WorkerConfig.drain_timeout_s, float,
        help="on SIGTERM, seconds to let in-flight requests finish before stopping")
    return p


def env_names(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Every environment variable the worker's flags read (for checks of deployment files)."""
    return EnvFlags(parser or build_parser("decode", "pdserve worker"), {}, ENV_ALIASES).names()


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_memory_fraction=args.kv_memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, model_id=args.model_id, attention_backend=args.attention_backend,
        cuda_graphs=bool(args.cuda_graphs), compile=bool(args.compile), remote_kv_budget=args.remote_kv_budget,
        tensor_parallel_size=args.tensor_parallel_size, structured_output_backend=args.structured_output_backend,
        quantization=args.quantization, quantization_group_size=args.quantization_group_size,
        grammar_compile_timeout_s=args.grammar_compile_timeout, speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        ngram_lookup_window=args.ngram_lookup_window, speculative_min_accepted=args.speculative_min_accepted,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        speculative_cost_gate=bool(args.speculative_cost_gate), draft_model=args.draft_model,
        draft_quantization=args.draft_quantization, draft_vocab_size=args.draft_vocab_size,
    )
    kv = KVTransferConfig(transport=args.kv_transport, host=args.kv_host or args.host, port=args.kv_port,
                          connect_timeout=args.kv_connect_timeout, transfer_timeout=args.kv_timeout,
                          lease_timeout=args.kv_lease_timeout, abort_grace=args.kv_abort_grace,
                          checksum=bool(args.kv_checksum), max_handshakes=args.kv_max_handshakes)
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    try:
        secret = read_secret(args.cluster_secret_file)
        redis_url = redis_url_with_password_file(args.redis_url, args.redis_password_file)
    except (AuthError, ValueError) as exc:
        raise ValueError(f"invalid config: {exc}") from None
    warn_password_on_command_line(args.redis_url, given_on_command_line(args, "redis_url"))
    return WorkerConfig(
        engine=engine, kv=kv, role=args.role, host=args.host, port=args.port, http=http_limits_from_args(args, "http_"),
        advertise_host=args.advertise_host, redis_url=redis_url, key_prefix=args.key_prefix,
        heartbeat_ttl_s=args.heartbeat_ttl, cluster_secret=secret,
        peer_connect_timeout_s=args.peer_connect_timeout, control_timeout_s=args.control_timeout,
        max_step_failures=args.max_step_failures, engine_watchdog_s=args.engine_watchdog,
        core_turns=args.core_turns, drain_timeout_s=args.drain_timeout,
        failure_drain_timeout_s=args.failure_drain_timeout, **extra,
    )
