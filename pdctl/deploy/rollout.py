"""Replace and remove workers without cutting a stream: ``pdctl rollout`` and ``pdctl scale``.

    rollout, per worker, one at a time:   drain (admin API) -> idle -> remove -> recreate from the
                                          current config and image -> healthy and registered -> next
    scale down:                           pick the replicas to remove (exited ones first, then the
                                          least loaded), drain exactly those, remove exactly those
    scale up:                             create the missing replicas, wait until they serve

The registry is the truth about workers; the backend (``pdctl.deploy.backends``) knows where they
run.  Every wait is bounded; a step that fails stops the operation with the rest untouched, and
whatever the operation drained but did not remove is put back in service first.  A backend command
that fails (exits non-zero, times out, is not installed) is an ``OperationError`` like any other
failed step; the backend is checked (``compose version``, the Deployments) before anything drains.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pdctl.deploy.backends import BACKEND_FAILURES, Backend, Replica, describe_failure


class OperationError(Exception):
    """A drain, a removal or a replacement did not complete; the message says which and why."""


@dataclass
class ScalePlan:
    """What ``scale`` will do, per service: the target count and the replicas it removes."""

    current: dict[str, int] = field(default_factory=dict)
    target: dict[str, int] = field(default_factory=dict)
    remove: dict[str, list[Replica]] = field(default_factory=dict)

    def describe(self, entries: dict[str, dict]) -> list[str]:
        lines = []
        for service, target in self.target.items():
            lines.append(f"{service}: {self.current[service]} -> {target} replica(s)")
            for r in self.remove.get(service, []):
                entry = entries.get(r.worker_id or "")
                load = entry.get("load", {}) if entry else {}
                what = (f"worker {r.worker_id}, {entry['state']}, {load.get('num_running', 0)} running, "
                        f"{load.get('num_waiting', 0)} waiting" if entry else
                        "not running" if not r.running else f"worker {r.worker_id or '?'}, not registered")
                lines.append(f"  remove {r.name} ({what})")
        return lines


class Operator:
    """Drives an ``AdminClient`` (drain, the registry) and a ``Backend`` (processes/containers)."""

    def __init__(self, client, backend: Backend, *, drain_timeout: float = 600.0, ready_timeout: float = 900.0,
                 stop_grace_s: float = 150.0, say: Callable[[str], None] = print, poll_s: float = 0.5):
        self.client, self.backend = client, backend
        self.drain_timeout, self.ready_timeout, self.stop_grace_s = drain_timeout, ready_timeout, stop_grace_s
        self.say, self.poll_s = say, poll_s
        self.events: list[tuple[str, str]] = []  # (what happened, replica name): the order, for tests

    def _event(self, what: str, replica: Replica, message: str) -> None:
        self.events.append((what, replica.name))
        self.say(message)

    def _backend(self, what: str, call: Callable, *args):
        """``call(*args)`` on the backend; a failed backend command becomes an OperationError."""
        try:
            return call(*args)
        except BACKEND_FAILURES as exc:
            raise OperationError(f"{what}: {describe_failure(exc)}") from None

    def check(self, services: list[str]) -> None:
        """The backend can run its commands (before anything is drained)."""
        self._backend("the backend does not answer", self.backend.check, services)

    def entries(self) -> dict[str, dict]:
        return {w["worker_id"]: w for w in self.client.workers()}

    # ---- building blocks ------------------------------------------------------------------

    def drain(self, replicas: list[Replica]) -> list[tuple[Replica, float, str]]:
        """Ask each registered replica to drain, then wait until each reports idle; returns the
        drained ones (replica, last heartbeat before, role) for ``_back_in_service``.  Where one
        cannot be drained, every replica this call drained is put back in service (its role set
        again: the way back from a drain) before the error is raised -- none is left parked, out of
        the pools and never removed."""
        entries = self.entries()
        started: list[tuple[Replica, float, str]] = []
        try:
            for r in replicas:
                entry = entries.get(r.worker_id or "")
                if entry is None:
                    continue  # not registered: nothing routes to it, nothing to finish
                before = entry.get("heartbeat_at", 0.0)
                self.client.drain(r.worker_id)
                self._event("drain", r, f"{r.service}: draining {r.name} (worker {r.worker_id})")
                started.append((r, before, entry["role"]))
            for r, before, _ in started:
                try:
                    self.client.wait_for(r.worker_id, lambda w: w["state"] == "idle", "idle", self.drain_timeout, before)
                except Exception as exc:
                    raise OperationError(f"{r.name} did not finish draining: {exc}") from None
                self._event("idle", r, f"{r.service}: {r.name} is idle")
        except Exception as exc:
            back = self._back_in_service(started)
            raise OperationError(f"{exc}" + (f" (back in service: {', '.join(back)})" if back else "")) from None
        return started

    def _removal_failed(self, exc: OperationError, drained: list[tuple[Replica, float, str]],
                        removed: set[str]) -> OperationError:
        """The error to raise after a failed removal, once the drained replicas not removed are back."""
        back = self._back_in_service([d for d in drained if d[0].handle not in removed])
        return OperationError(f"{exc}" + (f" (back in service: {', '.join(back)})" if back else ""))

    def _back_in_service(self, drained: list[tuple[Replica, float, str]]) -> list[str]:
        """Each of ``drained`` active again in its role, where it answers; their names."""
        back = []
        for r, _, role in drained:
            try:
                self.client.set_role(r.worker_id, role)
            except Exception as exc:  # noqa: BLE001 - said, and the others still tried
                self.say(f"{r.service}: {r.name} stays drained ({exc}): pdctl set-role {r.worker_id} {role}")
                continue
            self._event("back", r, f"{r.service}: {r.name} back in service as {role}")
            back.append(r.name)
        return back

    def remove(self, r: Replica) -> None:
        self._backend(f"removing {r.name}", self.backend.remove, r, self.stop_grace_s)
        self._event("removed", r, f"{r.service}: removed {r.name}")

    def wait_new(self, service: str, known: set[str], count: int, replaced: dict[str, float]) -> list[Replica]:
        """Wait until ``count`` replicas of ``service`` not in ``known`` are running, healthy and
        registered as active (a worker id seen in ``replaced`` must show a later ``started_at``)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            fresh = [r for r in self._backend(f"listing {service}", self.backend.replicas, service)
                     if r.handle not in known and r.running]
            entries = self.entries()
            ready = [r for r in fresh if r.worker_id in entries and entries[r.worker_id]["state"] == "active"
                     and entries[r.worker_id].get("started_at", 0.0) > replaced.get(r.worker_id, -1.0)
                     and self.backend.healthy(r)]
            if len(ready) >= count:
                for r in ready:
                    self._event("ready", r, f"{service}: {r.name} (worker {r.worker_id}) is healthy and registered")
                return ready
            if time.monotonic() > deadline:
                raise OperationError(f"{service}: {count - len(ready)} new replica(s) not healthy and registered within "
                                     f"{self.ready_timeout:g}s (seen: {[r.name for r in fresh]})")
            time.sleep(self.poll_s)

    # ---- rollout --------------------------------------------------------------------------

    def rollout(self, services: list[str], allow_outage: bool = False) -> list[tuple[Replica, Replica]]:
        """Replace every running replica of ``services``, one at a time."""
        self.check(services)
        replaced = []
        for service in services:
            for old in [r for r in self._backend(f"listing {service}", self.backend.replicas, service) if r.running]:
                entries = self.entries()
                if not allow_outage:
                    self._check_pool_survives(old, entries)
                all_now = self._backend(f"listing {service}", self.backend.replicas, service)
                started = {old.worker_id: entries[old.worker_id].get("started_at", 0.0)} if old.worker_id in entries else {}
                drained = self.drain([old])
                try:
                    self.remove(old)
                except OperationError as exc:
                    raise self._removal_failed(exc, drained, set()) from None
                try:
                    self._backend(f"recreating {service}", self.backend.ensure, service, len(all_now))
                except OperationError as exc:
                    raise OperationError(f"{exc}; {old.name} was removed and not replaced: {service} runs "
                                         f"{len(all_now) - 1} of {len(all_now)} (pdctl scale, once the backend works)"
                                         ) from None
                new = self.wait_new(service, {r.handle for r in all_now}, 1, started)[0]
                replaced.append((old, new))
        return replaced

    def _check_pool_survives(self, old: Replica, entries: dict[str, dict]) -> None:
        entry = entries.get(old.worker_id or "")
        if entry is None:
            return
        pools = ["prefill", "decode"] if entry["role"] == "both" else [entry["role"]]
        for pool in pools:
            others = [w for w in entries.values() if w["worker_id"] != old.worker_id and w["state"] == "active"
                      and w["role"] in (pool, "both")]
            if not others:
                raise OperationError(f"{old.name} is the only active worker of the {pool} pool: replacing it is an "
                                     f"outage (scale the pool to two first, or pass --allow-outage)")

    # ---- scale ----------------------------------------------------------------------------

    def plan_scale(self, targets: dict[str, int]) -> ScalePlan:
        plan = ScalePlan()
        entries = self.entries()
        for service, target in targets.items():
            if target < 0:
                raise ValueError(f"--{service} must be >= 0, got {target}")
            replicas = self._backend(f"listing {service}", self.backend.replicas, service)
            plan.current[service], plan.target[service] = len(replicas), target
            if target < len(replicas):
                plan.remove[service] = self.victims(replicas, len(replicas) - target, entries)
        return plan

    @staticmethod
    def victims(replicas: list[Replica], n: int, entries: dict[str, dict]) -> list[Replica]:
        """Exited replicas first, then running ones no registry entry knows, then the least loaded
        (running + waiting requests); ties go to the last name, as compose would pick."""

        def cost(r: Replica) -> tuple:
            entry = entries.get(r.worker_id or "")
            load = (entry or {}).get("load", {})
            return (r.running, entry is not None, load.get("num_running", 0) + load.get("num_waiting", 0))

        by_name = sorted(replicas, key=lambda r: r.name, reverse=True)
        return sorted(by_name, key=cost)[:n]

    def scale(self, plan: ScalePlan) -> None:
        """Drain and remove the plan's victims, then bring each service to its target.  Where a
        removal fails, the victims drained but not removed are put back in service."""
        self.check(list(plan.target))
        for service, victims in plan.remove.items():
            drained, removed = self.drain([r for r in victims if r.running]), set()
            for r in victims:
                try:
                    self.remove(r)
                except OperationError as exc:
                    raise self._removal_failed(exc, drained, removed) from None
                removed.add(r.handle)
        for service, target in plan.target.items():
            before = self._backend(f"listing {service}", self.backend.replicas, service)
            self._backend(f"scaling {service} to {target}", self.backend.ensure, service, target)
            missing = target - len(before)
            if missing > 0:
                self.wait_new(service, {r.handle for r in before}, missing, {})
