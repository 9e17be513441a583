"""What a simulation is given: the deployment (workers per role and their engine settings), how its
hosts behave (``HostEffects``), a measured run's machine speed to replay (``SpeedTrace``), and the
run's settings (``SimConfig``).  ``pdctl.planner.simulator`` runs it."""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any

from common.engine.config import SCHEDULING_DEFAULTS, EngineConfig, SchedulerConfig
from gateway.config import GatewayConfig
from pdctl.planner.cost_model import CostModel, RooflineCostModel
from pdctl.planner.hardware import LinkProfile, kv_blocks_per_gpu
from worker.config import WorkerConfig
from gateway.routing import RoutingConfig

DEFAULT_BUDGET = 1_500_000  # scheduler passes (request-steps) per simulation: ~10-20 s on one core


@dataclass(frozen=True)
class Deployment:
    """How many workers of each role, and how many GPUs each worker of a role spans (its
    tensor-parallel size: the pools may differ)."""

    prefill: int = 0
    decode: int = 0
    both: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    both_tp: int = 1

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError(f"worker counts must be >= 0, got {self}")
        if min(self.prefill_tp, self.decode_tp, self.both_tp) < 1:
            raise ValueError(f"tensor-parallel sizes must be >= 1, got {self}")
        if self.decode + self.both < 1:
            raise ValueError("a deployment needs at least one decode or colocated worker")

    def tp_of(self, role: str) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp, "both": self.both_tp}[role]

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp + self.both * self.both_tp

    @property
    def label(self) -> str:
        """``1P+2D``; with tensor parallelism ``1Px4+2Dx2`` (one prefill worker of 4 GPUs, two
        decode workers of 2)."""
        parts = [f"{n}{tag}" + (f"x{tp}" if tp > 1 else "")
                 for n, tag, tp in ((self.prefill, "P", self.prefill_tp), (self.decode, "D", self.decode_tp),
                                    (self.both, "C", self.both_tp)) if n]
        return "+".join(parts)

    @property
    def colocated(self) -> bool:
        return self.prefill == 0 and self.decode == 0


@dataclass(frozen=True)
class EngineSettings:
    """One worker's engine, as its flags would set it (see ``worker/config.py``)."""

    num_blocks: int
    block_size: int = EngineConfig.block_size
    max_num_batched_tokens: int = SCHEDULING_DEFAULTS["cpu"].max_num_batched_tokens
    max_num_seqs: int = SCHEDULING_DEFAULTS["cpu"].max_num_seqs
    max_model_len: int = SchedulerConfig.max_model_len
    watermark: float = SchedulerConfig.watermark
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    max_pending_requests: int = WorkerConfig.max_pending_requests
    scheduler_options: tuple[tuple[str, Any], ...] = ()  # any other SchedulerConfig field

    def scheduler_config(self) -> SchedulerConfig:
        """Built by ``SchedulerConfig`` itself, so its validation and new knobs apply unchanged."""
        names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        extra = dict(self.scheduler_options)
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown scheduler option(s) {unknown}; SchedulerConfig has {sorted(names)}")
        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                               max_model_len=self.max_model_len, watermark=self.watermark, **extra)


@dataclass(frozen=True)
class HostEffects:
    """What workers sharing a host's CPUs do to their own and each other's step times (CPU
    serving; all 0 for GPU workers, each on its own GPU).

    - ``contention``: each other worker busy stepping when a step starts makes it this fraction
      slower (cores, memory bandwidth and the serving processes around the engines are shared);
    - ``decode_contention``: instead, for a decode-only step, each other worker mid decode-only
      step (None: ``contention``).  Two decode steps each stream every weight from memory, so
      they slow each other more than a step beside a prompt's compute-bound chunk does (on the
      2-vCPU validation host about 0.2 against 0.05);
    - ``wake_slowdown``: a worker that wakes from idle runs cold (caches refilled, clocks
      ramping) -- its steps in the first ``wake_window_s`` of work are this fraction slower after
      an idle of ``wake_full_s`` or longer, that share of it after a shorter one.

    Every simulated worker counts as on the one host (a CPU deployment on one machine).
    ``pdctl.planner.calibrate.fit_host_effects`` fits them from probes of the real stack.
    """

    contention: float = 0.0
    wake_slowdown: float = 0.0
    wake_full_s: float = 2.0
    wake_window_s: float = 0.5
    decode_contention: float | None = None

    def __post_init__(self) -> None:
        if not (self.contention >= 0 and self.wake_slowdown >= 0 and self.wake_full_s > 0
                and self.wake_window_s >= 0 and (self.decode_contention is None or self.decode_contention >= 0)):
            raise ValueError(f"host effects must be >= 0 (wake_full_s > 0), got {self}")

    def step_time(self, seconds: float, other_busy: int, idle_before_s: float = 0.0, busy_for_s: float = 0.0,
                  decode_pairs: int = 0) -> float:
        """A step of ``seconds`` (the cost model's) beside ``other_busy`` busy workers, of which
        ``decode_pairs`` are mid decode-only step while this one is decode-only too, started
        ``busy_for_s`` into a busy period that followed ``idle_before_s`` of idle."""
        factor = 1.0 + self.contention * other_busy
        if decode_pairs and self.decode_contention is not None:
            factor += (self.decode_contention - self.contention) * decode_pairs
        if self.wake_slowdown and idle_before_s > 0 and busy_for_s < self.wake_window_s:
            factor += self.wake_slowdown * min(1.0, idle_before_s / self.wake_full_s)
        return seconds * factor


@dataclass(frozen=True)
class SpeedTrace:
    """The machine's speed over simulated time, replayed from a measured run
    (``pdctl.planner.live.speed_trace``): from ``starts[k]`` seconds on, a step that computes
    prompt tokens takes ``prefill[k]`` times what the cost model says, a decode-only step
    ``decode[k]`` times.  Before ``starts[0]``, the first factors hold."""

    starts: tuple[float, ...]
    prefill: tuple[float, ...]
    decode: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (len(self.starts) == len(self.prefill) == len(self.decode) > 0):
            raise ValueError("a speed trace needs as many prefill and decode factors as start times, at least one")
        if list(self.starts) != sorted(self.starts) or not all(f > 0 for f in (*self.prefill, *self.decode)):
            raise ValueError("a speed trace's start times must be sorted and its factors > 0")

    def factor(self, now: float, prefill: bool) -> float:
        k = max(0, bisect.bisect_right(self.starts, now) - 1)
        return self.prefill[k] if prefill else self.decode[k]


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation needs besides the deployment and the traffic."""

    cost: CostModel
    engine: EngineSettings
    prefill_engine: EngineSettings | None = None  # prefill workers' own settings (default: ``engine``)
    # The workers' KV blocks are what fits next to the weights of a GPU profile (``cost`` a roofline):
    # recomputed for a worker of several GPUs.  False: every worker has ``num_blocks`` as given.
    blocks_from_memory: bool = False
    link: LinkProfile = LinkProfile("loopback", 2e9, 100e-6)
    kv_bytes_per_token: float = 131072.0
    routing: RoutingConfig = RoutingConfig()
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    heartbeat_s: float = 5.0 / 3  # the worker's heartbeat: ttl / 3
    pool_refresh_s: float = 0.5  # the gateway re-reads the registry this often
    overhead_s: float = 0.0  # gateway + HTTP hops, added to TTFT and end-to-end latency
    host: HostEffects = HostEffects()  # workers sharing CPUs (all simulated workers on one host)
    speed: SpeedTrace | None = None  # the machine's speed over time, replayed from a run (validation)
    queue_size: int = GatewayConfig.queue_size  # the gateway's wait queue ...
    queue_timeout_s: float = GatewayConfig.queue_timeout  # ... and how long a request may wait in it
    drain_s: float | None = None  # simulated time after the last arrival (default: max(60, duration))
    stop_when_failing: bool = False  # stop as soon as the SLOs are certainly missed
    seed: int = 0

    def settings_for(self, role: str, tp: int = 1) -> EngineSettings:
        """A worker's engine: its role's settings, and with ``tp`` GPUs the KV blocks they hold."""
        settings = self.prefill_engine if role == "prefill" and self.prefill_engine else self.engine
        if not self.blocks_from_memory:
            return settings
        roofline = self._roofline()
        return dataclasses.replace(settings, num_blocks=kv_blocks_per_gpu(roofline.gpu, roofline.model,
                                                                         settings.block_size, tp=tp))

    def cost_for(self, tp: int) -> CostModel:
        """The step cost of a worker of ``tp`` GPUs."""
        return self.cost if tp == 1 else self._roofline().with_tp(tp)

    def kv_bytes_per_token_for(self, decode_tp: int) -> float:
        """What one prompt token's KV costs to ship to a decode worker of ``decode_tp`` GPUs:
        its ranks' heads, a replicated head once per rank holding it."""
        if decode_tp == 1:
            return self.kv_bytes_per_token
        model = self._roofline().model
        return self.kv_bytes_per_token * model.worker_kv_bytes_per_token(decode_tp) / model.kv_bytes_per_token

    def _roofline(self) -> RooflineCostModel:
        if not isinstance(self.cost, RooflineCostModel):
            raise ValueError("tensor parallelism is modelled from a GPU profile (--gpu); a calibration "
                             "(--calibration) measured one device and says nothing of collectives")
        return self.cost
