"""A worker's configuration, from command-line flags and ``PDSERVE_*`` environment variables."""
from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass, field

from common.cluster.auth import AuthError, ClusterAuth, configure_auth, read_secret
from common.engine.config import EngineConfig
from common.cluster.redis_util import redis_url_from_env
from kvtransfer.config import KVTransferConfig

ROLES = ("prefill", "decode", "both")


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
    redis_url: str = "redis://127.0.0.1:6379"
    key_prefix: str = "pdserve"
    heartbeat_ttl_s: float = 5.0
    admin_token: str | None = None
    max_pending_requests: int = 256  # beyond this, new requests get "busy"
    # Calls this worker makes to other workers: connecting (also waiting for a pooled connection),
    # and the whole of a control call (/abort).  A remote prefill is bounded by kv.transfer_timeout.
    peer_connect_timeout_s: float = 5.0
    control_timeout_s: float = 5.0
    # PDSERVE_CLUSTER_SECRET (or --cluster-secret-file): required unless every listener is on
    # loopback; never printed.
    cluster_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"invalid config: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"invalid config: port must be in 0..65535, got {self.port}")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"invalid config: heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
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


def _env(name: str, default):
    value = os.environ.get(f"PDSERVE_{name.upper()}")
    if value is None or value == "":  # compose files often set a variable to nothing: "unset"
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value


def build_parser(default_role: str, description: str) -> argparse.ArgumentParser:
    """Flags shared by ``python -m prefill_svc`` and ``python -m decode_svc``; every flag also
    reads ``PDSERVE_<FLAG>`` from the environment (e.g. ``PDSERVE_MODEL``, ``PDSERVE_KV_TRANSPORT``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--model", default=_env("model", "default"), help="HF checkpoint directory, .gguf file, or 'default'")
    add("--role", default=_env("role", default_role), choices=ROLES)
    add("--worker-id", default=_env("worker_id", None), help="unique id (default: hostname + random suffix)")
    add("--host", default=_env("host", "127.0.0.1"), help="HTTP bind address")
    add("--port", type=int, default=_env("port", 0), help="HTTP port (0: any free port)")
    add("--advertise-host", default=_env("advertise_host", None), help="address other hosts use to reach this worker")
    add("--kv-transport", default=_env("kv_transport", "ucx"), choices=("ucx", "tcp"))
    add("--kv-host", default=_env("kv_host", None), help="KV listen address (default: --host)")
    add("--kv-port", type=int, default=_env("kv_port", 0))
    add("--kv-timeout", type=float, default=_env("kv_timeout", 120.0),
        help="seconds a remote prefill may take, queueing on the prefill worker included: bounds both the "
             "/prefill call and the KV transfer (a dead peer is noticed at once through its connections; "
             "this bounds a hung one, after which the decode worker computes the prompt itself)")
    add("--kv-connect-timeout", type=float, default=_env("kv_connect_timeout", 5.0),
        help="seconds to connect to a peer's KV port and complete the handshake")
    add("--kv-lease-timeout", type=float, default=_env("kv_lease_timeout", 10.0),
        help="seconds a prefill worker waits for the decode worker's acknowledgement of a transfer")
    add("--kv-abort-grace", type=float, default=_env("kv_abort_grace", 5.0),
        help="seconds an aborted transfer's payload may keep landing (UCX) before its connection is closed")
    add("--peer-connect-timeout", type=float, default=_env("peer_connect_timeout", 5.0),
        help="seconds to connect to another worker's HTTP API")
    add("--control-timeout", type=float, default=_env("control_timeout", 5.0),
        help="seconds for a control call to another worker (abort)")
    add("--kv-checksum", action="store_true", default=_env("kv_checksum", "") in ("1", "true"))
    add("--redis-url", default=redis_url_from_env())
    add("--key-prefix", default=_env("key_prefix", "pdserve"))
    add("--heartbeat-ttl", type=float, default=_env("heartbeat_ttl", 5.0))
    add("--admin-token", default=_env("admin_token", None), help="token for /admin (default: admin API disabled)")
    add("--cluster-secret-file", default=_env("cluster_secret_file", None),
        help="file holding the cluster secret (default: PDSERVE_CLUSTER_SECRET); required unless --host and "
             "--kv-host are loopback addresses")
    add("--device", default=_env("device", "auto"))
    add("--dtype", default=_env("dtype", "auto"))
    add("--block-size", type=int, default=_env("block_size", 16))
    add("--num-blocks", type=int, default=_env("num_blocks", None))
    add("--kv-memory-fraction", type=float, default=_env("kv_memory_fraction", 0.2))
    add("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 512))
    add("--max-num-seqs", type=int, default=_env("max_num_seqs", 64))
    add("--max-model-len", type=int, default=_env("max_model_len", None))
    add("--model-id", default=_env("model_id", None), help="model name served to clients")
    add("--log-level", default=_env("log_level", "INFO"))
    add("--drain-timeout", type=float, default=_env("drain_timeout", 30.0),
        help="on SIGTERM, seconds to let in-flight requests finish before stopping")
    return p


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    num_blocks = int(args.num_blocks) if args.num_blocks not in (None, "") else None
    max_model_len = int(args.max_model_len) if args.max_model_len not in (None, "") else None
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=num_blocks, kv_memory_fraction=args.kv_memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, model_id=args.model_id,
    )
    kv = KVTransferConfig(transport=args.kv_transport, host=args.kv_host or args.host, port=args.kv_port,
                          connect_timeout=args.kv_connect_timeout, transfer_timeout=args.kv_timeout,
                          lease_timeout=args.kv_lease_timeout, abort_grace=args.kv_abort_grace,
                          checksum=bool(args.kv_checksum))
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    try:
        secret = read_secret(args.cluster_secret_file)
    except AuthError as exc:
        raise ValueError(f"invalid config: {exc}") from None
    return WorkerConfig(
        engine=engine, kv=kv, role=args.role, host=args.host, port=args.port,
        advertise_host=args.advertise_host, redis_url=args.redis_url, key_prefix=args.key_prefix,
        heartbeat_ttl_s=args.heartbeat_ttl, admin_token=args.admin_token, cluster_secret=secret,
        peer_connect_timeout_s=args.peer_connect_timeout, control_timeout_s=args.control_timeout, **extra,
    )
