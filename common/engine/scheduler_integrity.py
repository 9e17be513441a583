"""The scheduler's invariants, asserted: for tests, the property tests and debug builds."""
from __future__ import annotations

from common.engine.request import RequestStatus


def check_scheduler(s) -> None:
    """Of ``s``, a ``common.engine.scheduler.Scheduler`` (which calls this): assert that the pool is
    sound, that every reference on a block has an owner (a block table or a pin), and that every
    request is in exactly one place, in a state that fits it."""
    s.kv_manager.check_integrity()
    places = {
        "running": (s.running, {RequestStatus.RUNNING}),
        "waiting": (s.waiting, {RequestStatus.WAITING, RequestStatus.PREEMPTED}),
        "landed": (s.landed, {RequestStatus.WAITING}),
        "reservations": (list(s.reservations.values()), {RequestStatus.WAITING_FOR_REMOTE_KV}),
    }
    seen: dict[str, str] = {}
    for place, (requests, states) in places.items():
        for request in requests:
            request_id = request.request_id
            assert request_id not in seen, f"{request_id!r} is in both {seen[request_id]} and {place}"
            seen[request_id] = place
            assert request.status in states, f"{request_id!r} is in {place} as {request.status.name}"
            assert s.requests.get(request_id) is request, f"{request_id!r} is in {place} but not among the requests"
            if place == "waiting":
                assert not s.kv_manager.holds(request_id), f"waiting request {request_id!r} holds blocks"
            else:
                capacity = s.kv_manager.num_blocks_of(request_id) * s.block_size
                assert capacity >= request.num_computed_tokens, f"{request_id!r} has KV beyond its blocks"
    assert set(s.handoff.decode.leases) <= set(s.reservations), "a lease without a reservation"
    assert s.remote_claim is None or s.remote_claim.request_id not in s.reservations, "a granted claim is still held"
    assert s.local_claim is None or s.requests.get(s.local_claim.request_id) is s.local_claim, (
        "the local claim belongs to a request that has ended")
    assert s._num_waiting_releasing == sum(not r.hold_blocks_on_finish for r in s.waiting), (
        "the count of waiting requests that free their blocks on finish is off")
    assert set(seen) == set(s.requests), f"requests in no queue: {set(s.requests) - set(seen)}"
    assert not s.held & set(s.requests), "a held request is still unfinished"
    owners = set(s.requests) | s.held
    unknown = set(s.kv_manager.req_to_blocks) - owners
    assert not unknown, f"block tables of unknown requests: {unknown}"
