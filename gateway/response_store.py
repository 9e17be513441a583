"""Stored responses of OpenAI's Responses API, in Redis: what ``store``, ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{response_id}`` read and write.

A finished response is stored (unless its request said ``store: false``) before the client has it --
before the whole response is sent, or a stream's last event -- so the client's next request finds it
(a stream that fails or is cut off is not stored: its answer says ``store: false``).  It is kept as
the response object the client got and the conversation it closes: the messages of the response it
continued (``previous_response_id``), its own input's, then its output as an assistant message (its
text and function calls).  A request continuing it gets those messages before its own input;
instructions are not carried over (the request's own ``instructions`` are its system message), as
OpenAI's are not.

    {prefix}:responses:{key id}:{response id}  STRING  StoredResponse (msgpack), EX ttl
    {prefix}:responses:{key id}                ZSET    that key's stored ids, score = when stored (s)
    {prefix}:responses:{key id}:sizes          HASH    that key's stored ids -> their bytes
    {prefix}:responses:{key id}:{response id}:run     STRING  a background response's run mark
    {prefix}:responses:{key id}:{response id}:events  LIST    a streamed background response's events
                                                              (the run's: gateway/response_runs.py)
    {prefix}:responses:{key id}:{conversation id}...          a conversation (gateway/conversation_store.py),
                                                              in the key's index and sizes as a response

Each API key reads and deletes only its own (its key id is in the key; without API keys every caller
is the one tenant ``anonymous``).  Ids are ``resp_`` and 32 random hex digits.  What a stranger can
hold: an API key's ``max_per_key`` newest responses within ``max_bytes_per_key`` bytes in all
(storing one more forgets that key's oldest until both hold; ids past their TTL count until then --
the oldest go first), each at most ``max_bytes`` (a conversation grown past that is not stored: the
answer says ``store: false``), for ``ttl_s`` seconds (a conversation: ``conversation_ttl_s`` after its
last change; the key's index and sizes: the longer of the two).  Every Redis call is bounded
by ``timeout_s``: a response that could not be stored is answered all the same (logged, counted); a
stored response that cannot be read is a 503.  After a call Redis failed or did not answer, the store
does not ask it again for ``retry_s`` (saves are skipped, reads are 503s at once): a Redis that does not
answer costs one request the timeout, not every request.  What Redis returns is decoded into its declared
types, never trusted as given.  Where there are no API keys a response id is all it takes to read a
response: no id is logged or echoed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from common.cluster.redis_util import UNAVAILABLE_ERRORS
from gateway.openai_errors import OpenAIError, invalid
from gateway.openai_protocol import ChatMessage

log = logging.getLogger(__name__)

RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")
CONVERSATION_PREFIX = "conv_"  # a conversation's id (gateway/conversation_store.py): it shares the key's bounds
DEFAULT_TTL_S = 86400.0  # a day
DEFAULT_CONVERSATION_TTL_S = 30 * 86400.0  # a conversation, after its last change
MAX_TTL_S = 365 * 86400.0
DEFAULT_MAX_PER_KEY = 1000
DEFAULT_MAX_BYTES_PER_KEY = 64 << 20
ANSWERED = ("completed", "incomplete")  # the statuses of a response with an output to continue
RUNNING = ("queued", "in_progress")  # a background response's run mark while it runs
CANCELLED = "cancelled"
_REDIS_FAILURES = (TimeoutError, *UNAVAILABLE_ERRORS, redis.exceptions.RedisError)


class StoredResponse(msgspec.Struct, array_like=True):
    """A stored response: its JSON as answered, the conversation it closes, and how many of that
    conversation's messages were its own input (those before its output, the last message).
    ``answered``: the conversation ends with its output (not so for a background response that has
    not finished, was cancelled or failed: it can be read, not continued); ``running``: a background
    response not finished, whose status is its run mark's (gateway/response_runs.py)."""

    response: bytes
    messages: list[ChatMessage]
    inputs: int = 0
    answered: bool = True
    running: bool = False
    streamed: bool = False  # a background response created with stream: true (its events are kept)

    @property
    def input_messages(self) -> list[ChatMessage]:
        end = len(self.messages) - (1 if self.answered else 0)
        return self.messages[max(0, end - self.inputs):end]

    def status(self) -> str:
        return str(msgspec.json.decode(self.response).get("status", ""))

    def in_conversation(self) -> bool:
        """Whether it is a response of a conversation (it keeps its own turn only: the conversation holds
        the rest)."""
        return bool(msgspec.json.decode(self.response).get("conversation"))


_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder().encode
_decode = msgspec.msgpack.Decoder(StoredResponse).decode


# KEYS: the key's index and sizes, then each object's three keys (``parts``).  ARGV: each object's id
# and its score when the bounds were read: one written since (a conversation appended to) is kept.
_FORGET = """
for i = 1, #ARGV, 2 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) <= tonumber(ARGV[i + 1]) then
    local k = 3 + 3 * (i - 1) / 2
    redis.call('DEL', KEYS[k], KEYS[k + 1], KEYS[k + 2])
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
return 1
"""


def not_found(param: str | None = None) -> OpenAIError:
    """No stored response by that id (for this API key): a 404, or a 400 naming ``param``."""
    code = "previous_response_not_found" if param == "previous_response_id" else None
    return OpenAIError(400 if param else 404, "No stored response has that id.", param=param, code=code)


def unavailable() -> OpenAIError:
    return OpenAIError(503, "stored responses are unavailable (Redis does not answer)")


def ended(response: msgspec.Struct, history: list[ChatMessage], output: list[ChatMessage], inputs: int,
          streamed: bool = False) -> StoredResponse:
    """A response that ended, to store: its conversation (``history``, its input's last ``inputs``)
    then its output -- not a failed response's (it cannot be continued)."""
    answered = response.status in ANSWERED
    return StoredResponse(_json(response), [*history, *(output if answered else ())], inputs, answered,
                          streamed=streamed)


def keeper(store: "ResponseStore", key_id: str, history: list[ChatMessage], inputs: int):
    """What stores a finished response of API key ``key_id`` whose conversation before its output is
    ``history``, its last ``inputs`` messages the request's input (``ResponsesAnswer``'s keeper)."""
    async def keep(response: msgspec.Struct, output: list[ChatMessage], closing: list[bytes] = ()) -> bool:
        return await store.save(key_id, response.id, ended(response, history, output, inputs))
    return keep


def store_disabled(field: str) -> OpenAIError:
    return invalid(f"{field}: this gateway stores no responses (--responses-store-ttl 0)", field, "unsupported_value")


class ResponseStore:
    """The stored responses of one deployment (``key_prefix``); see the module docstring."""

    FAILURES = _REDIS_FAILURES  # what a Redis call that failed or did not answer raises

    def __init__(self, redis: aioredis.Redis, *, key_prefix: str, ttl_s: float = DEFAULT_TTL_S,
                 conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S,
                 max_per_key: int = DEFAULT_MAX_PER_KEY, max_bytes_per_key: int = DEFAULT_MAX_BYTES_PER_KEY,
                 max_bytes: int, timeout_s: float, retry_s: float = 0.0, on_failure=lambda: None):
        if not (0 < ttl_s <= MAX_TTL_S and 0 < conversation_ttl_s <= MAX_TTL_S and max_per_key >= 1
                and max_bytes_per_key >= 1 and max_bytes >= 1 and 0 < timeout_s < math.inf and 0 <= retry_s < math.inf):
            raise ValueError(f"response store: ttl_s and conversation_ttl_s must be in (0, {MAX_TTL_S:g}]; "
                             f"max_per_key, max_bytes_per_key, max_bytes and timeout_s positive and finite, retry_s "
                             f"finite; got {ttl_s}, {conversation_ttl_s}, {max_per_key}, {max_bytes_per_key}, "
                             f"{max_bytes}, {timeout_s}, {retry_s}")
        self.redis, self.prefix = redis, f"{key_prefix}:responses"
        self.ttl_s, self.max_per_key, self.timeout_s = max(1, round(ttl_s)), max_per_key, timeout_s
        self.conversation_ttl_s = max(1, round(conversation_ttl_s))
        # A key's index and sizes outlive every object they count, responses and conversations alike.
        self.index_ttl_s = max(self.ttl_s, self.conversation_ttl_s)
        self.max_bytes_per_key, self.max_bytes = max_bytes_per_key, min(max_bytes, max_bytes_per_key)
        self.on_failure, self.retry_s = on_failure, retry_s
        self._quiet_until = 0.0  # monotonic: Redis is not asked before then (it failed)
        self._forget_script = redis.register_script(_FORGET)

    def record_failure(self) -> None:
        """A Redis call failed: counted, and Redis is left alone for ``retry_s``."""
        self.on_failure()
        self._quiet_until = time.monotonic() + self.retry_s

    def quiet(self) -> bool:
        """Whether Redis failed less than ``retry_s`` ago (then it is not asked)."""
        return time.monotonic() < self._quiet_until

    @contextlib.asynccontextmanager
    async def call(self, patient: bool = False):
        """One Redis call, bounded by ``timeout_s``: one that fails or does not answer is recorded
        and raises the 503 ``OpenAIError``, as does any while Redis is left alone (``patient``: a
        run's call, made anyway)."""
        if not patient and self.quiet():
            raise unavailable()
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except _REDIS_FAILURES:
            self.record_failure()
            raise unavailable() from None

    def index_key(self, key_id: str) -> str:
        return f"{self.prefix}:{key_id}"

    def sizes_key(self, key_id: str) -> str:
        return f"{self.prefix}:{key_id}:sizes"

    def _key(self, key_id: str, response_id: str) -> str:
        return f"{self.prefix}:{key_id}:{response_id}"

    def _run_key(self, key_id: str, response_id: str) -> str:
        return f"{self.prefix}:{key_id}:{response_id}:run"

    def _events_key(self, key_id: str, response_id: str) -> str:
        return f"{self.prefix}:{key_id}:{response_id}:events"

    def parts(self, key_id: str, object_id: str) -> list[str]:
        """A stored object's keys: a response's (itself, its run mark, its events), or a
        conversation's (itself, its item ids, its items: gateway/conversation_store.py)."""
        if object_id.startswith(CONVERSATION_PREFIX):
            base = self._key(key_id, object_id)
            return [base, f"{base}:ids", f"{base}:items"]
        return [self._key(key_id, object_id), self._run_key(key_id, object_id), self._events_key(key_id, object_id)]

    async def save(self, key_id: str, response_id: str, stored: StoredResponse,
                   run_lease_s: float | None = None) -> bool:
        """Store it, then forget the key's oldest past its bounds; False where it was not stored: too
        large, or Redis did not take it in time (logged).  Once it is stored, a failure to forget the
        oldest is logged only (the next save forgets them).  ``run_lease_s``: a background response's
        shell, stored with its run mark ``queued`` for that long (gateway/response_runs.py)."""
        data = _encode(stored)
        if len(data) > self.max_bytes:
            log.warning("a response was not stored: its conversation takes %d bytes, over the store's %d",
                        len(data), self.max_bytes)
            return False
        if self.quiet():
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.set(self._key(key_id, response_id), data, ex=self.ttl_s)
                    if run_lease_s is not None:
                        pipe.set(self._run_key(key_id, response_id), RUNNING[0], px=milliseconds(run_lease_s))
                    self.count(pipe, key_id, response_id, len(data))
                    *_, ids, held = await pipe.execute()
        except _REDIS_FAILURES as exc:
            self.record_failure()
            log.warning("a response was not stored: Redis: %s", type(exc).__name__)
            return False
        await self.forget_past_bounds(key_id, ids, held)
        return True

    def count(self, pipe, key_id: str, object_id: str, size: int) -> None:
        """Queue on ``pipe`` a new object's place in its key's bounds (the newest, of ``size`` bytes),
        then a read of those bounds: the pipe's last two results, for ``forget_past_bounds``."""
        index, sizes = self.index_key(key_id), self.sizes_key(key_id)
        pipe.zadd(index, {object_id: time.time()})
        pipe.hset(sizes, object_id, size)
        pipe.expire(index, self.index_ttl_s)
        pipe.expire(sizes, self.index_ttl_s)
        pipe.zrange(index, 0, -1, withscores=True)  # oldest first
        pipe.hgetall(sizes)

    async def forget_past_bounds(self, key_id: str, ids: list[tuple[bytes, float]], held: dict[bytes, bytes]) -> None:
        """Forget the key's oldest past its bounds (``ids`` and ``held``: ``count``'s read of them)."""
        await self._forget(key_id, self._past_bounds(ids, held))

    async def keep_bounds(self, key_id: str) -> None:
        """Forget the key's oldest past its bounds (after a write outside ``save``: a run's end)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.zrange(self.index_key(key_id), 0, -1, withscores=True)
                    pipe.hgetall(self.sizes_key(key_id))
                    ids, held = await pipe.execute()
        except _REDIS_FAILURES as exc:
            self.record_failure()
            log.warning("an API key's oldest stored responses were not forgotten: Redis: %s", type(exc).__name__)
            return
        await self.forget_past_bounds(key_id, ids, held)

    async def _forget(self, key_id: str, oldest: list[tuple[bytes, float]]) -> None:
        """Forget these stored objects (the oldest past the key's bounds, with their scores when the
        bounds were read), each only where it was not written since (a failure is logged only)."""
        if not oldest:
            return
        keys = [self.index_key(key_id), self.sizes_key(key_id),
                *(key for old, _ in oldest for key in self.parts(key_id, old.decode()))]
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._forget_script(keys=keys, args=[a for old, score in oldest for a in (old, repr(score))])
        except _REDIS_FAILURES as exc:
            self.record_failure()
            log.warning("an API key's oldest stored responses were not forgotten: Redis: %s", type(exc).__name__)

    def _past_bounds(self, ids: list[tuple[bytes, float]], held: dict[bytes, bytes]) -> list[tuple[bytes, float]]:
        """The oldest of ``ids`` (the index: ids and scores) to forget so that at most ``max_per_key``
        of them, of at most ``max_bytes_per_key`` bytes in all (``held``: each one's), are left (the
        newest always is)."""
        sizes = [int(held.get(i) or 0) for i, _ in ids]
        total, drop = sum(sizes), 0
        while drop < len(ids) - 1 and (len(ids) - drop > self.max_per_key or total > self.max_bytes_per_key):
            total -= sizes[drop]
            drop += 1
        return ids[:drop]

    async def load(self, key_id: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The key's stored response -- a background response still running as its run mark tells
        it (``as_run``); a 404 where there is none, a 503 where Redis does not answer in time.
        ``param`` given (``previous_response_id``): a response to continue -- a 400 naming it where
        there is none, or it has no output to continue (running, cancelled or failed)."""
        if not RESPONSE_ID_RE.fullmatch(response_id):
            raise not_found(param)
        async with self.call(), self.redis.pipeline(transaction=True) as pipe:  # (as one, between a run's scripts)
            pipe.get(self._key(key_id, response_id))
            pipe.get(self._run_key(key_id, response_id))
            data, mark = await pipe.execute()
        if data is None:
            raise not_found(param)
        try:
            stored = _decode(data)
        except msgspec.DecodeError:  # (a ValidationError is one)
            log.warning("a stored response is unreadable; treated as absent")
            raise not_found(param) from None
        if stored.running:
            stored = as_run(stored, mark)
        if param is not None and not stored.answered:
            raise invalid(f"{param}: that response has no output to continue (it is {stored.status()})", param,
                          "response_not_continuable")
        if param is not None and stored.in_conversation():
            raise invalid(f"{param}: that response is part of a conversation; continue the conversation (send "
                          "conversation) instead", param, "response_not_continuable")
        return stored

    async def delete(self, key_id: str, response_id: str) -> None:
        """Forget it (a background response still running stops at its next heartbeat); a 404 where
        the key has none by that id, a 503 where Redis does not answer."""
        if not RESPONSE_ID_RE.fullmatch(response_id) or not await self.remove(key_id, response_id):
            raise not_found()

    async def remove(self, key_id: str, object_id: str) -> bool:
        """Forget a stored object (a response, a conversation) with all its keys and its place in the
        key's bounds; whether it was there.  A 503 where Redis does not answer."""
        parts = self.parts(key_id, object_id)
        async with self.call(), self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(parts[0])
            pipe.delete(*parts[1:])
            pipe.zrem(self.index_key(key_id), object_id)
            pipe.hdel(self.sizes_key(key_id), object_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)


LOST = "the gateway running this response stopped before it finished"


def milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def as_run(stored: StoredResponse, mark: bytes | None) -> StoredResponse:
    """A running background response as its run mark tells it: the mark's status (queued,
    in_progress, cancelled), or ``failed`` where the mark is gone -- its gateway stopped, or lost
    Redis for its lease, before it finished."""
    status = mark.decode() if mark is not None else ""
    response = msgspec.json.decode(stored.response)
    if status not in (*RUNNING, CANCELLED):
        status, response["error"] = "failed", {"code": "server_error", "message": LOST}
    response["status"] = status
    return msgspec.structs.replace(stored, response=_json(response))
