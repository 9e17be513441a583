"""The planner's simulated gateway around the real router: a burst spread over the decode workers
before any heartbeat shows it (gateway.decode_load.SentToDecode), and the wait queue as
gateway.backpressure.WaitQueue runs it -- busy answers, first come first served, deadlines, a full
queue, and room found passed on doubled (ADMITTED_WAKES)."""
from __future__ import annotations

import dataclasses

import numpy as np

from common.engine.scheduler import Scheduler
from pdctl.planner.sim_config import Deployment, SimConfig
from pdctl.planner.simulator import Simulation
from pdctl.planner.traffic import Workload
from tests.support.planner_support import config


def decode_side_admissions(monkeypatch, sim: Simulation) -> dict[str, int]:
    """Counts, per worker, the requests it took as their decode worker (a reservation for a remote
    prompt, or a prompt it computes itself); filled in as ``sim`` runs."""
    owner = {id(w.scheduler): wid for wid, w in sim.workers.items()}
    counts = {wid: 0 for wid in sim.workers}
    for name in ("add_request", "reserve_remote"):
        original = getattr(Scheduler, name)

        def spy(self, request, *args, _original=original, **kwargs):
            result = _original(self, request, *args, **kwargs)
            if request.sampling_params.max_tokens > 1 and result is not False and id(self) in owner:
                counts[owner[id(self)]] += 1
            return result

        monkeypatch.setattr(Scheduler, name, spy)
    return counts


def test_a_burst_spreads_over_the_decode_workers_before_any_heartbeat_shows_it(monkeypatch):
    # Eight requests at once: every heartbeat still says both workers are idle, but the gateway
    # counts what it sent each one (gateway.decode_load.SentToDecode, driven on simulated time).
    burst = Workload(np.zeros(8), np.full(8, 100), np.full(8, 40))
    sim = Simulation(Deployment(both=2), burst, config())
    counts = decode_side_admissions(monkeypatch, sim)
    result = sim.run()
    assert result["completed"] == 8
    assert counts == {"b0": 4, "b1": 4}


def two_prompts_for_one_room(**changes) -> tuple[Workload, SimConfig]:
    """Two 600-token prompts at once for a decode worker whose 64 blocks hold one of them."""
    wl = Workload(np.zeros(2), np.full(2, 600), np.full(2, 200))
    return wl, dataclasses.replace(config(num_blocks=64), **changes)


def test_a_decode_worker_without_room_answers_busy_and_the_request_waits_at_the_gateway():
    wl, cfg = two_prompts_for_one_room()
    sim = Simulation(Deployment(1, 1), wl, cfg)
    result = sim.run()
    # The second prompt is not computed on the decode worker instead (the real decode worker
    # answers "busy"): it waits in the gateway's queue until the first stream ends, then goes
    # the remote way like the first.
    assert result["completed"] == 2 and result["errors"] == 0
    assert result["remote_prefills"] == 2 and result["local_prefills"] == 0
    assert result["queued_requests"] == 1 and result["decode_busy_answers"] >= 1
    assert sim.first_token[1] > sim.finish[0]


def test_a_newcomer_queues_behind_a_waiting_request_as_the_gateways_queue_does(monkeypatch):
    # As gateway.backpressure.WaitQueue: the short prompt would fit beside the first stream, but the
    # second long prompt waits already, so it queues behind it instead of overtaking: it is taken
    # after the long one (passed on by it, as it got room), once the first stream has ended.
    wl = Workload(np.array([0.0, 0.0, 0.01]), np.array([600, 600, 20]), np.array([200, 200, 4]))
    sim = Simulation(Deployment(1, 1), wl, config(num_blocks=64))
    taken = decode_side_admission_order(monkeypatch, sim)
    result = sim.run()
    assert result["completed"] == 3 and result["errors"] == 0
    assert result["queued_requests"] == 2
    assert [i for i, _ in taken] == [0, 1, 2] and taken[2][1] >= sim.finish[0]


def test_a_request_that_waits_past_the_queue_timeout_or_finds_the_queue_full_fails_as_saturated():
    wl, cfg = two_prompts_for_one_room(queue_timeout_s=0.2)  # the first stream takes longer than this
    sim = Simulation(Deployment(1, 1), wl, cfg)
    result = sim.run()
    assert result["completed"] == 1 and result["errors"] == 1
    assert sim.outcome[1] == "error:saturated"
    wl, cfg = two_prompts_for_one_room(queue_size=0)
    sim = Simulation(Deployment(1, 1), wl, cfg)
    assert sim.run()["errors"] == 1 and sim.outcome[1] == "error:saturated"


def decode_side_admission_order(monkeypatch, sim: Simulation) -> list[tuple[int, float]]:
    """``(request index, simulated time)`` of each request its decode worker took (a reservation
    for a remote prompt, or a prompt it computes itself), in the order taken; filled in as ``sim``
    runs."""
    taken: list[tuple[int, float]] = []
    for name in ("add_request", "reserve_remote"):
        original = getattr(Scheduler, name)

        def spy(self, request, *args, _original=original, _refused=None if name == "reserve_remote" else False,
                **kwargs):
            result = _original(self, request, *args, **kwargs)
            if request.sampling_params.max_tokens > 1 and result is not _refused:
                taken.append((int(request.request_id), sim.now))
            return result

        monkeypatch.setattr(Scheduler, name, spy)
    return taken


def test_room_for_many_is_taken_by_everyone_waiting_at_once_as_the_gateways_queue_passes_it_on(monkeypatch):
    # A 1900-token prompt holds the decode worker's blocks; four 200-token prompts wait for room.
    # When it ends, room for all four is free: the first woken gets it and wakes two more, who wake
    # the last (Place.admitted passes ADMITTED_WAKES on) -- all four are taken at that instant, not
    # one per stream end or pool refresh.
    wl = Workload(np.array([0.0] + [0.01] * 4), np.array([1900] + [200] * 4), np.array([60] + [8] * 4))
    sim = Simulation(Deployment(1, 1), wl, config(num_blocks=128))
    taken = decode_side_admission_order(monkeypatch, sim)
    result = sim.run()
    assert result["completed"] == 5 and result["errors"] == 0 and result["queued_requests"] == 4
    assert taken == [(0, 0.0)] + [(i, sim.finish[0]) for i in range(1, 5)]
