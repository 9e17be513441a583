"""The Redis key schema, in one place (registry, prefix index, gateway and ops scripts use it).

    {prefix}:{model}:workers             ZSET    member = worker_id, score = entry expiry (unix ms,
                                                 worker clock); an index of who registered, pruned
                                                 by readers once an entry is long gone
    {prefix}:{model}:worker:{worker_id}  STRING  WorkerInfo as JSON, PX = heartbeat TTL; its
                                                 existence is what "alive" means
    {prefix}:{model}:blocks:{worker_id}  SET     32-byte prefix-block hashes cached on that
                                                 worker, PX = heartbeat TTL (refreshed by the
                                                 worker's index publisher)

``prefix`` separates deployments sharing one Redis (tests use a unique one each); ``model`` is the
served model id verbatim, so two models never share cache entries or workers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_KEY_PREFIX = "pdserve"  # of every Redis key a deployment writes; one per stack
WORKER_ID_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
KEY_PREFIX_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_MODEL_ID_LEN = 256


def check_worker_id(worker_id: str) -> str:
    if not isinstance(worker_id, str) or not WORKER_ID_RE.fullmatch(worker_id):
        raise ValueError(f"worker_id {worker_id!r}: use 1-128 of [A-Za-z0-9._:@-]")
    return worker_id


def check_model_id(model: str) -> str:
    if (not isinstance(model, str) or not model or len(model) > MAX_MODEL_ID_LEN
            or any(c.isspace() for c in model)):
        raise ValueError(f"model id {model!r}: must be 1-{MAX_MODEL_ID_LEN} characters without whitespace")
    return model


@dataclass(frozen=True)
class RedisKeys:
    """Key names for one deployment (``prefix``) and one served model."""

    prefix: str
    model: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not KEY_PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"key prefix {self.prefix!r}: use 1-64 of [A-Za-z0-9._:-]")
        check_model_id(self.model)

    @property
    def workers(self) -> str:
        return f"{self.prefix}:{self.model}:workers"

    @property
    def worker_key_prefix(self) -> str:
        return f"{self.prefix}:{self.model}:worker:"

    def worker(self, worker_id: str) -> str:
        return self.worker_key_prefix + check_worker_id(worker_id)

    def blocks(self, worker_id: str) -> str:
        return f"{self.prefix}:{self.model}:blocks:{check_worker_id(worker_id)}"
