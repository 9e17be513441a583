"""The decode worker's calls to a prefill worker, and what it accepts back.

The prefill worker is named by id; its address comes from its signed registry entry (``peers``),
never from the request.  Calls are signed with the cluster secret for that worker's current run
(``WorkerInfo.audience``: a worker that now holds the address under another id, or the same
worker restarted since, refuses them); answers are read bounded and
every field of a PrefillResult is checked before anything of it reaches the engine, because the
first token is committed to the request and its blocks to the prefix cache:

    first_token_id     in [0, vocab_size)             (an id outside crashes the model's embedding)
    num_sent_blocks    == the blocks asked for
    num_cached_tokens  in [0, prompt length (with a moved stream's resumed tokens)]
    first_logprob      None unless logprobs were asked for; then for first_token_id, finite, <= 0,
                       at most ``logprobs`` alternatives, each inside the vocabulary
    prompt_logprobs    None unless prompt_logprobs were asked for; then one entry per prompt token
                       after the first, each for that token, checked as first_logprob is (at most
                       ``prompt_logprobs`` alternatives), with its rank in [1, vocab_size]
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import NoReturn

import aiohttp

from common.cluster.messages import (
    MAX_FRAME_BYTES, AbortRequest, PrefillRequest, PrefillResult, TokenLogprob, decode, encode, read_response,
)
from common.cluster.registry import WorkerInfo
from worker.role_context import RoleContext

log = logging.getLogger(__name__)

MAX_RESULT_BYTES = 64 << 10  # a PrefillResult is a few hundred bytes; an error message a few more
# ... plus, where it scores the prompt (``prompt_logprobs``), at most this per entry and per alternative
# (msgpack: an entry's array, id and float64 about 20 bytes, an alternative's about 16).
SCORED_ENTRY_BYTES, SCORED_ALTERNATIVE_BYTES = 24, 20
LOGPROB_SLACK = 1e-3  # log-softmax rounding can land a hair above 0


# While a prefill worker computes a prompt, how often its registry entry is looked at: a worker
# stopped (SIGSTOP, a frozen host) keeps its sockets open, so only the entry's lapse tells.
PEER_WATCH_S = 1.0


class BadPrefillAnswer(Exception):
    """The prefill worker's answer cannot be used (the message says which field and why)."""


class PrefillPeerLeft(Exception):
    """The prefill worker left the registry (or a new run of it replaced it) while computing the prompt."""


async def call_prefill_while_listed(context: RoleContext, peer: WorkerInfo, prefill: PrefillRequest,
                                    watch_s: float = PEER_WATCH_S) -> PrefillResult:
    """``call_prefill``, given up with ``PrefillPeerLeft`` once ``peer``'s registry entry has lapsed
    or belongs to a new run -- the decode worker then computes the prompt itself, as for a peer
    that died (a stopped one held every request it had for as long as the transfer's bound)."""
    call = asyncio.ensure_future(call_prefill(context, peer, prefill))
    watch = asyncio.ensure_future(_until_gone(context, peer, watch_s))
    try:
        await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # (cancelled too; an outcome not returned is still retrieved: never "never retrieved")
        for task in (call, watch):
            task.cancel()
            task.add_done_callback(_retrieved)
    if call.done() and not call.cancelled():
        return call.result()
    return watch.result()  # raises PrefillPeerLeft


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def _until_gone(context: RoleContext, peer: WorkerInfo, watch_s: float) -> NoReturn:
    """Raise ``PrefillPeerLeft`` once ``peer``'s entry has been absent for as long as its own time to
    live (a heartbeat late once is no departure), or a new run of it registered."""
    ttl = max(peer.expires_at - peer.heartbeat_at, watch_s)
    absent_since = None
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(watch_s)
        entry = await context.peers.get(peer.worker_id)
        if entry is not None and entry.instance != peer.instance:
            raise PrefillPeerLeft(f"prefill worker {peer.worker_id} restarted while computing the prompt")
        if entry is not None:
            absent_since = None
        elif absent_since is None:
            absent_since = loop.time()
        elif loop.time() - absent_since >= ttl:
            raise PrefillPeerLeft(f"prefill worker {peer.worker_id} left the registry while computing the prompt "
                                  f"(its entry gone for {loop.time() - absent_since:.0f} s)")


async def resolve_prefill_worker(context: RoleContext, worker_id: str, moved_stream: bool = False) -> WorkerInfo:
    """The registry entry of prefill worker ``worker_id``; BadPrefillAnswer if it is not one.  For
    a ``moved_stream`` any worker of the model may compute its KV (the decode worker it left, in
    a live move)."""
    peer = await context.peers.get(worker_id)
    if peer is None:
        raise BadPrefillAnswer(f"prefill worker {worker_id!r} has no verified registry entry")
    if peer.role not in ("prefill", "both") and not moved_stream:
        raise BadPrefillAnswer(f"worker {worker_id!r} is registered as {peer.role}, not as a prefill worker")
    return peer


async def call_prefill(context: RoleContext, peer: WorkerInfo, prefill: PrefillRequest) -> PrefillResult:
    """POST the request to ``peer`` and return its checked result; raises on any failure."""
    data = encode(prefill)
    headers = context.auth.sign_request("POST", "/prefill", data, audience=peer.audience)
    # The whole remote prefill (queueing on the prefill worker included) is bounded like the KV transfer.
    connect = context.config.peer_connect_timeout_s
    timeout = aiohttp.ClientTimeout(total=context.config.kv.transfer_timeout, connect=connect, sock_connect=connect)
    async with context.peer_http.post(f"{peer.http_address}/prefill", data=data, headers=headers,
                                       timeout=timeout) as resp:
        try:
            raw = await read_response(resp, result_bytes(prefill))
        except ValueError as exc:
            raise BadPrefillAnswer(f"prefill worker {peer.worker_id}: {exc}") from None
        try:
            result = decode(raw, PrefillResult)
        except ValueError as exc:
            detail = raw[:200].decode(errors="replace") if resp.status != 200 else exc
            raise BadPrefillAnswer(f"prefill worker {peer.worker_id} answered {resp.status}: {detail}") from None
        if resp.status != 200 or result.error:
            raise BadPrefillAnswer(f"prefill worker {peer.worker_id} answered {resp.status}: {result.error}")
    check_prefill_result(result, prefill, context.model.vocab_size)
    return result


def result_bytes(asked: PrefillRequest) -> int:
    """The most bytes an answer to ``asked`` may take: a frame's worth at most."""
    alternatives = asked.sampling_params.prompt_logprobs
    if alternatives is None:
        return MAX_RESULT_BYTES
    scored = len(asked.prompt_token_ids) - 1
    return min(MAX_FRAME_BYTES, MAX_RESULT_BYTES + scored * (SCORED_ENTRY_BYTES + alternatives * SCORED_ALTERNATIVE_BYTES))


def check_prefill_result(result: PrefillResult, asked: PrefillRequest, vocab_size: int) -> None:
    """Raise BadPrefillAnswer unless every field of ``result`` fits the request ``asked``."""

    def bad(message: str) -> BadPrefillAnswer:
        return BadPrefillAnswer(f"rejected PrefillResult: {message}")

    if result.first_token_id is None or not 0 <= result.first_token_id < vocab_size:
        raise bad(f"first_token_id {result.first_token_id} is outside the vocabulary [0, {vocab_size})")
    if result.num_sent_blocks != len(asked.dst_block_ids):
        raise bad(f"num_sent_blocks is {result.num_sent_blocks}, {len(asked.dst_block_ids)} were asked for")
    num_kv_tokens = len(asked.prompt_token_ids) + len(asked.resume_token_ids)
    if not 0 <= result.num_cached_tokens <= num_kv_tokens:
        raise bad(f"num_cached_tokens {result.num_cached_tokens} is outside [0, {num_kv_tokens}]")
    alternatives = asked.sampling_params.logprobs
    lp = result.first_logprob
    if lp is not None:
        if alternatives is None:
            raise bad("first_logprob was sent but no logprobs were asked for")
        _check_logprob(lp, result.first_token_id, alternatives, vocab_size, "first_logprob", bad)
    scored, alternatives = result.prompt_logprobs, asked.sampling_params.prompt_logprobs
    if scored is None and alternatives is None:
        return
    prompt = asked.prompt_token_ids
    if scored is None or alternatives is None or len(scored) != len(prompt) - 1:
        raise bad(f"prompt_logprobs has {'no' if scored is None else len(scored)} entries; "
                  f"{'none were' if alternatives is None else len(prompt) - 1} asked for")
    for i, entry in enumerate(scored):
        _check_logprob(entry, prompt[i + 1], alternatives, vocab_size, f"prompt_logprobs[{i}]", bad)
        if entry.rank is None or not 1 <= entry.rank <= vocab_size:
            raise bad(f"prompt_logprobs[{i}] has rank {entry.rank}, not in [1, {vocab_size}]")


def _check_logprob(lp: TokenLogprob, token_id: int, alternatives: int, vocab_size: int, name: str, bad) -> None:
    """``lp`` scores ``token_id`` with at most ``alternatives`` others, every token in the
    vocabulary and every log-probability <= 0."""
    if lp.token_id != token_id:
        raise bad(f"{name} is for token {lp.token_id}, not {token_id}")
    if len(lp.top) > alternatives:
        raise bad(f"{name} has {len(lp.top)} alternatives, at most {alternatives} were asked for")
    for named, logprob in [(lp.token_id, lp.logprob), *lp.top]:
        if not 0 <= named < vocab_size:
            raise bad(f"{name} names token {named}, outside the vocabulary")
        if not (math.isfinite(logprob) or logprob == -math.inf) or logprob > LOGPROB_SLACK:
            raise bad(f"{name} has log-probability {logprob} (must be <= 0)")


async def send_abort(context: RoleContext, peer: WorkerInfo, request_id: str) -> None:
    """Tell the prefill worker to stop ``request_id``; best effort, bounded."""
    data = encode(AbortRequest(request_id))
    headers = context.auth.sign_request("POST", "/abort", data, audience=peer.audience)
    try:
        # Bounded by the session's default: the control-call timeout.
        async with context.peer_http.post(f"{peer.http_address}/abort", data=data, headers=headers) as resp:
            await read_response(resp, 4096)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        log.info("could not tell prefill worker %s to abort %s: %s", peer.worker_id, request_id, exc)
