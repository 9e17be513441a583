"""The gateway's prefix lookup asks Redis for exactly the hashes the workers' engines compute
(same function, model id and cache_salt), hashes a prompt once per request, and hashes long
prompts off the event loop.  A recording stand-in replaces Redis: this tests the code above it."""
from __future__ import annotations

import threading

from common.engine.kv.prefix_hash import block_extra_keys
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from gateway import dispatch
from gateway.dispatch import HASH_INLINE_BLOCKS, Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.routing import Router, RoutingConfig
from tests.support.dispatch_stubs import BS, MODEL, Pool, worker


class RecordingIndex:
    """Answers that p0 holds every block asked about, and records what was asked (and where)."""

    def __init__(self):
        self.asked: list[tuple[str, list[bytes]]] = []

    async def longest_prefix(self, model, hashes, worker_ids):
        self.asked.append((model, list(hashes)))
        return {"p0": len(hashes)}


def make_dispatcher(index) -> Dispatcher:
    return Dispatcher(Pool([worker("p0", "prefill"), worker("d0", "decode")]),
                      Router(RoutingConfig(skip_prefill_below_tokens=0)), index, None, None, GatewayMetrics(), MODEL)


def engine_hashes(prompt, salt):
    """What a worker's engine commits and publishes for this prompt (engine.make_request's keys)."""
    return Request("r", prompt, SamplingParams(), extra_keys=block_extra_keys(MODEL, salt)).update_block_hashes(BS)


async def test_lookup_hashes_are_the_engines_for_the_same_salt(monkeypatch):
    threads = []
    real = dispatch.hash_prompt_blocks

    def recording(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*args)

    monkeypatch.setattr(dispatch, "hash_prompt_blocks", recording)
    index = RecordingIndex()
    d = make_dispatcher(index)
    short = [i % 500 for i in range(20 * BS + 3)]
    long = [i % 500 for i in range((HASH_INLINE_BLOCKS + 5) * BS)]
    for prompt in (short, long):
        for salt in (None, "tenant-a"):
            route = await d.choose(prompt, set(), salt)
            assert route.prefill.worker_id == "p0" and route.prefill_matched_tokens == len(prompt) // BS * BS
            assert index.asked[-1] == (MODEL, engine_hashes(prompt, salt))
    assert index.asked[0][1] != index.asked[1][1]  # another salt, other hashes
    assert threads == [True, True, False, False]  # a long prompt is hashed in a thread


async def test_a_prompt_is_hashed_once_per_request(monkeypatch):
    calls = []
    real = dispatch.hash_prompt_blocks
    monkeypatch.setattr(dispatch, "hash_prompt_blocks", lambda *args: calls.append(1) or real(*args))
    d = make_dispatcher(RecordingIndex())
    hashed = {}
    prompt = list(range(4 * BS))
    first = await d.choose(prompt, set(), "s", hashed)
    again = await d.choose(prompt, {"p1"}, "s", hashed)  # a retry of the same request
    assert len(calls) == 1 and first.prefill_matched_tokens == again.prefill_matched_tokens == 4 * BS
