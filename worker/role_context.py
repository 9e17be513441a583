"""What a role module may use of the worker that hosts it: ``RoleContext``, and ``RoleModule``, the
part of a worker a service package plugs in.

The worker process (``worker``) knows nothing about prefill or decode: each service package
(``prefill_svc``, ``decode_svc``) registers a ``RoleModule`` whose ``install(context, app)`` adds its
HTTP routes and engine-thread hooks.  A worker process hosts every role module, so its role can
change at run time without a restart; the role only decides which of them accept new requests
(``RoleContext.accepts``).

    python -m decode_svc  ->  worker.main.main("decode", ...): load_role_modules() -> [PREFILL, DECODE]
                                   Worker.start(): module.install(worker.role_context(), app)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    import asyncio

    import aiohttp
    import torch
    from aiohttp import web

    from common.cluster.auth import ClusterAuth
    from common.engine.sampling_params import SamplingParams
    from common.engine.structured.backend import CompiledGrammar
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.sender import KVSender
    from worker.config import WorkerConfig
    from worker.engine_thread import EngineThread
    from worker.in_flight import InFlight
    from worker.metrics import WorkerMetrics
    from worker.peers import PeerDirectory
    from worker.recent import RecentLatency


@dataclass(frozen=True)
class ModelShape:
    """The facts of the served model and its KV cache that requests are checked against."""

    vocab_size: int
    block_size: int  # tokens per KV block
    block_nbytes: int  # bytes of one KV block, every layer
    max_model_len: int
    device: "torch.device"
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RoleContext:
    """Everything a role module uses of its worker, and nothing else.

    ``engine`` runs calls in the engine thread between steps and streams its outputs; the KV
    ``sender`` and ``receiver`` move blocks to and from peers; ``peers`` resolves a peer's signed
    registry entry, ``peer_http`` and ``auth`` call it; ``in_flight`` tracks this worker's
    requests (``accepts`` says whether a new one may start); ``spawn`` starts a task that shutdown
    still cancels; ``on_kv_written`` holds the model runner's hooks, called in the engine thread
    once a step's KV is written; ``compile_grammar`` compiles a request's grammar off the engine
    thread and the event loop (``None`` without one; ``GrammarError``, a 400, when it cannot;
    ``CompilerBusy``, a 503, when no compile thread started it in time);
    ``movable_streams`` holds the requests whose gateway can move them on (a drain hands those
    over: ``EngineThread.hand_over``); ``exported(stream_id)`` says a handed-over stream's KV has
    been asked for and shipped, or failed to (the drain waits for that)."""

    config: "WorkerConfig"
    model: ModelShape
    engine: "EngineThread"
    on_kv_written: list
    kv_sender: "KVSender"
    kv_receiver: "KVReceiver"
    peers: "PeerDirectory"
    peer_http: "aiohttp.ClientSession"
    auth: "ClusterAuth"
    in_flight: "InFlight"
    accepts: Callable[[str], "tuple[str, str] | None"]
    spawn: Callable[..., "asyncio.Task"]
    metrics: "WorkerMetrics"
    ttft: "RecentLatency"
    tpot: "RecentLatency"
    reservation_lease_s: float
    compile_grammar: Callable[["SamplingParams"], "Awaitable[CompiledGrammar | None]"]
    movable_streams: set
    exported: Callable[[str], None]

    @property
    def worker_id(self) -> str:
        return self.config.worker_id


@dataclass(frozen=True)
class RoleModule:
    """One role's part of a worker.

    ``install(context, app)`` runs once in ``Worker.start()``, after the engine thread and the KV
    endpoints are built and before the engine thread starts or the HTTP server listens: it adds the
    role's routes to ``app`` and appends its hooks to ``context.engine.after_step`` and
    ``context.on_kv_written``.
    """

    name: str
    install: Callable[[RoleContext, "web.Application"], None]
