"""The gateway's own count of prompt tokens each worker is computing (``pending_prefill``) covers
a prompt a colocated worker computes itself, not only remote prefills: the next prompt is not
sent to prefill on a worker already busy with a local one just because its last heartbeat
predates it.  Stand-ins replace the registry and Redis: this tests the code above them."""
from __future__ import annotations

import random

from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.routing import Router, RoutingConfig
from tests.support.dispatch_stubs import BS, MODEL, Pool, worker


class NoPrefixes:
    async def longest_prefix(self, model, hashes, worker_ids):
        return {}


def sent(d: Dispatcher, route, request_id: str, prompt: list[int]) -> None:
    """What ``Dispatcher.generate`` records as it sends a request along ``route``."""
    d._count_pending(route, len(prompt), +1)
    d.sent_to_decode.add(route.decode.worker_id, request_id, -(-len(prompt) // BS))


async def test_a_colocated_workers_local_prompt_counts_as_its_pending_prefill():
    rng = random.Random(0)
    for n in range(20):  # prompts with different first blocks: the affinity tie-break varies
        d = Dispatcher(Pool([worker("b0", "both"), worker("b1", "both")]), Router(RoutingConfig()), NoPrefixes(),
                       None, None, GatewayMetrics(), MODEL)
        first = [rng.randrange(1, 30000) for _ in range(380)]
        route = await d.choose(first, set())
        computing = (route.prefill or route.decode).worker_id
        sent(d, route, "r1", first)
        assert d.pending_prefill == {computing: 380}
        # Sent before any heartbeat shows the first: it is computed on the other worker, wherever
        # it decodes.
        second = [rng.randrange(1, 30000) for _ in range(467)]
        route2 = await d.choose(second, set())
        assert (route2.prefill or route2.decode).worker_id != computing, n
        # The first token (or the request's end) takes the prompt off the count.
        d._count_pending(route, len(first), -1)
        assert d.pending_prefill == {}
