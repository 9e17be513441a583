"""A background response's run in Redis, beside its stored response (gateway/response_store.py): its
**run mark** (``queued``, ``in_progress``, ``cancelled``; renewed for a lease while it runs) and, for
one created with ``stream: true``, its **events** -- the SSE events of its stream, one list element
each, in order, so an element's index is its ``sequence_number`` (a client resumes after one).

A run *holds* while its mark is ``queued`` or ``in_progress`` and its stored response is there; each
step below is one Redis script that checks that and acts, so a cancel, a delete and a run's end never
both win: events are appended, the mark renewed and the end stored (with its stream's last events)
only while it holds.  A cancel marks it ``cancelled``, then rewrites the stored response so.  An API
key's bytes count a streamed response's events as they are appended (its bound on stored bytes), and
one response's events are at most the store's per-response bound (and the batch that crosses it).  A
run's calls do not wait out the store's quiet time after a Redis failure (a run outlives one failed
call): events Redis did not take are kept and appended with the next ones, so an event's index stays
its sequence number.
"""
from __future__ import annotations

import asyncio
import logging

import msgspec

from gateway.openai_errors import OpenAIError, invalid
from gateway.openai_protocol import ChatMessage
from gateway.response_store import (
    CANCELLED, RUNNING, ResponseStore, StoredResponse, as_run, ended, milliseconds,
)

log = logging.getLogger(__name__)

_HOLDS = ("local mark = redis.call('GET', KEYS[1]) "
          "if (mark ~= 'queued' and mark ~= 'in_progress') or redis.call('EXISTS', KEYS[2]) == 0 then return 0 end ")
# KEYS: mark, stored response, events, sizes, index
_RENEW = _HOLDS + "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1"
# Events are appended after the ``base`` the run knows is there (an append Redis took though its answer
# was lost is not appended again: the run is the list's one writer).
_PUSH = ("local n, added = redis.call('LLEN', KEYS[3]), 0 "
         "for i = FIRST + math.max(0, n - tonumber(ARGV[BASE])), #ARGV do "
         "redis.call('RPUSH', KEYS[3], ARGV[i]) added = added + #ARGV[i] end ")
_APPEND = _HOLDS + _PUSH.replace("FIRST", "4").replace("BASE", "3") + (
    "if added > 0 then redis.call('HINCRBY', KEYS[4], ARGV[2], added) end "
    "redis.call('EXPIRE', KEYS[3], ARGV[1]) return 1")
_FINISH = _HOLDS + _PUSH.replace("FIRST", "7").replace("BASE", "5") + (
    "redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2]) redis.call('HSET', KEYS[4], ARGV[3], ARGV[4]) "
    "if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ARGV[2]) end "
    "redis.call('EXPIRE', KEYS[4], ARGV[6]) redis.call('EXPIRE', KEYS[5], ARGV[6]) "
    "redis.call('DEL', KEYS[1]) return 1")
_FINISH_TRIES = (0.5, 1.0, None)  # a run's end is tried again after these pauses (a Redis that did not answer)
_CANCEL = _HOLDS + "redis.call('SET', KEYS[1], 'cancelled', 'EX', ARGV[1]) return 1"
_END = _HOLDS + "redis.call('DEL', KEYS[1]) return 1"
_STILL = _HOLDS + "return 1"


def running_shell(queued: msgspec.Struct, history: list[ChatMessage], inputs: int, streamed: bool) -> StoredResponse:
    """A background response's shell (``queued``, no output yet)."""
    return StoredResponse(msgspec.json.encode(queued), list(history), inputs, answered=False, running=True,
                          streamed=streamed)


def run_keeper(runs: "RunStore", key_id: str, history: list[ChatMessage], inputs: int, streamed: bool):
    """``ResponsesAnswer``'s keeper for a background response: its end stored unless its run no
    longer holds (``closing``: its stream's last events, appended with it)."""
    async def keep(response: msgspec.Struct, output: list[ChatMessage], closing: list[bytes] = ()) -> bool:
        return await runs.finish(key_id, response.id, ended(response, history, output, inputs, streamed), closing)
    return keep


class RunStore:
    """The runs of one deployment's background responses, over its ``ResponseStore``."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._scripts = {source: store.redis.register_script(source)
                         for source in (_RENEW, _APPEND, _FINISH, _CANCEL, _END, _STILL)}
        self._bytes: dict[tuple[str, str], int] = {}  # each run's events so far (this gateway's runs)
        self._sent: dict[tuple[str, str], int] = {}  # how many of them Redis took
        self._unsent: dict[tuple[str, str], list[bytes]] = {}  # the others

    async def _script(self, source: str, key_id: str, response_id: str, args: list) -> int:
        """Run a run script (its keys: mark, stored response, events, sizes, index); a 503 where Redis
        does not answer."""
        store = self.store
        stored, mark, events = store.parts(key_id, response_id)
        keys = [mark, stored, events, store.sizes_key(key_id), store.index_key(key_id)]
        async with store.call(patient=True):
            return int(await self._scripts[source](keys=keys, args=args))

    async def renew(self, key_id: str, response_id: str, lease_s: float, generating: bool) -> bool:
        """Mark the run ``in_progress`` (``generating``) or ``queued`` for ``lease_s`` more; False: it is
        to stop (cancelled, deleted, forgotten, or its lease lapsed).  Raises the 503 ``OpenAIError``
        where Redis does not answer."""
        status = RUNNING[1] if generating else RUNNING[0]
        return await self._script(_RENEW, key_id, response_id, [status, milliseconds(lease_s)]) == 1

    async def holds(self, key_id: str, response_id: str) -> bool:
        """Whether the run still holds (not cancelled, deleted, forgotten or lapsed); raises the 503
        ``OpenAIError`` where Redis does not answer."""
        return await self._script(_STILL, key_id, response_id, []) == 1

    async def append(self, key_id: str, response_id: str, events: list[bytes]) -> bool:
        """Append stream events while the run holds (False: it does not; where Redis does not answer,
        they wait for the next call); raises a 500 ``OpenAIError`` past the store's bound on one
        response's bytes."""
        key = (key_id, response_id)
        if self._bytes.get(key, 0) > self.store.max_bytes:
            raise OpenAIError(500, f"the response's events are over the store's bound ({self.store.max_bytes} bytes)")
        self._bytes[key] = self._bytes.get(key, 0) + sum(map(len, events))  # (the batch that crosses it is kept:
        events = self._unsent.pop(key, []) + events                          # its sequence numbers are given)
        try:
            holds = await self._script(_APPEND, key_id, response_id,
                                       [self.store.ttl_s, response_id, self._sent.get(key, 0), *events]) == 1
        except OpenAIError:
            self._unsent[key] = events
            return True
        self._sent[key] = self._sent.get(key, 0) + len(events)
        return holds

    def forget(self, key_id: str, response_id: str) -> None:
        """The run ended here: what this gateway held of it goes."""
        for held in (self._bytes, self._sent, self._unsent):
            held.pop((key_id, response_id), None)

    @property
    def held(self) -> int:
        """The runs this gateway holds events of (each ended run forgotten)."""
        return len(self._bytes.keys() | self._sent.keys() | self._unsent.keys())

    async def finish(self, key_id: str, response_id: str, stored: StoredResponse, closing: list[bytes] = ()) -> bool:
        """Store a background response's end (and its stream's ``closing`` events) unless its run no
        longer holds; whether it was stored.  Its bytes, events included, count in its key's bound."""
        data = msgspec.msgpack.encode(stored)
        key = (key_id, response_id)
        size = len(data) + self._bytes.pop(key, 0) + sum(map(len, closing))  # (unsent events counted already)
        closing = self._unsent.pop(key, []) + list(closing)
        base = self._sent.pop(key, 0)
        store = self.store
        if len(data) > store.max_bytes:
            log.warning("a background response's end was not stored: %d bytes, over the store's %d",
                        len(data), store.max_bytes)
            await self.end(key_id, response_id)
            return False
        for pause in _FINISH_TRIES:  # (tried again: one that Redis took finds the run ended, and stores nothing)
            try:
                if await self._script(_FINISH, key_id, response_id,
                                      [data, store.ttl_s, response_id, size, base, store.index_ttl_s, *closing]) != 1:
                    return False
                break
            except OpenAIError:
                if pause is None:
                    log.warning("a background response's end was not stored: Redis did not answer")
                    await self.end(key_id, response_id)
                    return False
                await asyncio.sleep(pause)
        await store.keep_bounds(key_id)
        return True

    async def end(self, key_id: str, response_id: str) -> None:
        """Give up a run that will not finish (its gateway stops, or its end could not be stored):
        its mark goes, so reads say ``failed`` at once (a failure here is logged: its lease lapses)."""
        self.forget(key_id, response_id)
        try:
            await self._script(_END, key_id, response_id, [])
        except OpenAIError:
            log.warning("a background response's run mark was not dropped: Redis did not answer")

    async def cancel(self, key_id: str, response_id: str) -> bytes:
        """``POST /v1/responses/{response_id}/cancel``: the response after -- ``cancelled``, or as it
        ended where it had (cancelling twice is cancelling once); a 400 for a response not run in the
        background, a 404 where there is none, a 503 where Redis does not answer."""
        store = self.store
        stored = await store.load(key_id, response_id)
        if not stored.running:
            if not msgspec.json.decode(stored.response).get("background"):
                raise invalid("only responses created with background: true can be cancelled", "response_id")
            return stored.response
        if await self._script(_CANCEL, key_id, response_id, [store.ttl_s]) != 1:
            return (await store.load(key_id, response_id)).response  # it ended meanwhile
        cancelled = msgspec.structs.replace(as_run(stored, CANCELLED.encode()), running=False)
        stored_key, mark, _ = store.parts(key_id, response_id)
        try:  # the stored response says so itself (until then, its mark does)
            async with asyncio.timeout(store.timeout_s):
                async with store.redis.pipeline(transaction=True) as pipe:
                    pipe.set(stored_key, msgspec.msgpack.encode(cancelled), xx=True, keepttl=True)
                    pipe.delete(mark)
                    await pipe.execute()
        except store.FAILURES as exc:
            store.record_failure()
            log.warning("a cancelled response's mark stays (Redis: %s)", type(exc).__name__)
        return cancelled.response

    async def events(self, key_id: str, response_id: str, start: int) -> tuple[list[bytes], bool]:
        """The run's events from index ``start`` on, and whether it still holds (more may come); a
        503 where Redis does not answer."""
        store = self.store
        _, mark, events = store.parts(key_id, response_id)
        async with store.call(patient=True), store.redis.pipeline(transaction=True) as pipe:  # (as one)
            pipe.lrange(events, start, -1)
            pipe.get(mark)
            found, held = await pipe.execute()
        return found, held is not None and held.decode() in RUNNING
