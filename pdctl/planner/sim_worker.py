"""One simulated worker: a real ``Scheduler`` over a real ``BlockPool``, stepped by the events of
``pdctl.planner.simulator``, with the registry entry it would publish and its statistics."""
from __future__ import annotations

import inspect
import math

import msgspec

from common.cluster.registry import Capacity, KVAddress, Load, WorkerInfo
from common.engine.kv.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.scheduler import Scheduler
from pdctl.planner.sim_config import EngineSettings


class Job:
    """A prompt a worker prefills for another worker: what it has shipped so far."""

    __slots__ = ("request", "source", "dest", "next_index", "arrives", "index", "pending")

    def __init__(self, request: Request, source: "SimWorker", dest: "SimWorker", next_index: int, index: int,
                 pending: int):
        self.request = request
        self.source = source
        self.dest = dest
        self.next_index = next_index  # first block index not shipped yet (cached ones are skipped)
        self.arrives = 0.0  # when the last shipped byte lands
        self.index = index
        self.pending = pending  # prompt tokens the gateway counts as pending on the source


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager, clock) -> Scheduler:
    """A real ``Scheduler``; on simulated time where it takes a clock (reservation leases)."""
    if "clock" in inspect.signature(Scheduler).parameters:
        return Scheduler(config, kv, clock=clock)
    return Scheduler(config, kv)


class SimWorker:
    """One worker: a real ``Scheduler`` over a real ``BlockPool``, stepped by events."""

    def __init__(self, worker_id: str, role: str, settings: EngineSettings, clock=lambda: 0.0):
        self.worker_id = worker_id
        self.role = role
        self.settings = settings
        self.pool = BlockPool(settings.num_blocks, enable_caching=settings.enable_prefix_caching)
        self.scheduler = make_scheduler(settings.scheduler_config(),
                                         KVCacheManager(self.pool, settings.block_size), clock)
        self.busy = False
        self.current = None  # the SchedulerOutput of the step in flight
        self.decoding = False  # the step in flight is decode-only
        self.jobs: dict[str, Job] = {}
        self.between_steps: list = []  # the event loop's calls waiting for the step in flight to end
        self.link_out_free = 0.0
        self.link_in_free = 0.0
        self.last_step_end = -math.inf  # idle since ever: the first step wakes it
        self.idle_before = math.inf  # the idle that preceded the current busy period
        self.busy_since = 0.0
        # statistics
        self.busy_time = 0.0
        self.steps = 0
        self.prefill_tokens = 0
        self.usage_area = 0.0
        self.usage_peak = 0.0
        self.last_usage_time = 0.0
        self.preemptions = 0
        self._info = WorkerInfo(
            worker_id=worker_id, role=role, model="simulated", http_address=f"sim://{worker_id}",
            kv_address=KVAddress(transport="tcp", host="sim", port=1),
            capacity=Capacity(num_kv_blocks=settings.num_blocks, block_size=settings.block_size,
                              max_num_seqs=settings.max_num_seqs),
            state="active")
        self._rate_mark = (0.0, 0)
        self.info = self.heartbeat(0.0)

    def heartbeat(self, now: float) -> WorkerInfo:
        """This worker's registry entry now (what ``Worker.info`` reports)."""
        s = self.scheduler
        waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting) + sum(
            r.num_prompt_tokens - r.num_computed_tokens for r in s.running
            if r.num_computed_tokens < r.num_prompt_tokens)
        t0, c0 = self._rate_mark
        rate = (self.prefill_tokens - c0) / (now - t0) if now > t0 else 0.0
        self._rate_mark = (now, self.prefill_tokens)
        load = Load(num_waiting=len(s.waiting), num_running=len(s.running),
                    kv_usage=min(1.0, max(0.0, self.pool.usage)), num_waiting_prefill_tokens=waiting_tokens,
                    prefill_tokens_per_s=max(0.0, rate))
        self.info = msgspec.structs.replace(self._info, load=load, heartbeat_at=now)
        return self.info

    def note_usage(self, now: float) -> None:
        usage = self.pool.usage
        self.usage_area += usage * (now - self.last_usage_time)
        self.last_usage_time = now
        if usage > self.usage_peak:
            self.usage_peak = usage

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt this worker caches (what the Redis prefix index would say)."""
        cached = self.pool.cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n
