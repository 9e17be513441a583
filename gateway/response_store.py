"""Stored responses of OpenAI's Responses API, in Redis: what ``store``, ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{response_id}`` read and write.

A finished response is stored (unless its request said ``store: false``) before the client has it --
before the whole response is sent, or a stream's last event -- so the client's next request finds it.
It is kept as the response object the client got and the conversation it closes: the messages of
the response it continued (``previous_response_id``), its own input's, then its output as an
assistant message (its text and function calls).  A request continuing it gets those messages
before its own input; instructions are not carried over (the request's own ``instructions`` are
its system message), as OpenAI's are not.

    {prefix}:responses:{key id}:{response id}  STRING  StoredResponse (msgpack), EX ttl
    {prefix}:responses:{key id}                ZSET    that key's stored ids, score = when stored (s)

Each API key reads and deletes only its own (its key id is in the key; without API keys every caller
is the one tenant ``anonymous``).  Ids are ``resp_`` and 32 random hex digits.  What a stranger can
hold: ``max_per_key`` responses an API key (storing one more deletes that key's oldest), each at most
``max_bytes`` (a conversation grown past that is not stored: the answer says ``store: false`` and
the log says why), for ``ttl_s`` seconds.  Every Redis call is bounded by ``timeout_s``: a response
that could not be stored is answered all the same (logged, counted); a stored response that cannot
be read is a 503.  What Redis returns is decoded into its declared types, never trusted as given.
"""
from __future__ import annotations

import asyncio
import logging
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
DEFAULT_TTL_S = 86400.0  # a day
DEFAULT_MAX_PER_KEY = 1000


class StoredResponse(msgspec.Struct, array_like=True):
    """A stored response: its JSON as answered, the conversation it closes, and how many of that
    conversation's messages were its own input (those before its output, the last message)."""

    response: bytes
    messages: list[ChatMessage]
    inputs: int = 0

    @property
    def input_messages(self) -> list[ChatMessage]:
        return self.messages[max(0, len(self.messages) - 1 - self.inputs):-1]


_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder().encode
_decode = msgspec.msgpack.Decoder(StoredResponse).decode


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    code = "previous_response_not_found" if param == "previous_response_id" else None
    status = 400 if param else 404
    return OpenAIError(status, f"Response with id '{response_id}' not found.", param=param, code=code)


def keeper(store: "ResponseStore", key_id: str, history: list[ChatMessage], inputs: int):
    """What stores a finished response of API key ``key_id`` whose conversation before its output is
    ``history``, its last ``inputs`` messages the request's input (``ResponsesAnswer``'s keeper)."""
    async def keep(response: msgspec.Struct, output: list[ChatMessage]) -> bool:
        return await store.save(key_id, response.id, StoredResponse(_json(response), [*history, *output], inputs))
    return keep


def store_disabled(field: str) -> OpenAIError:
    return invalid(f"{field}: this gateway stores no responses (--responses-store-ttl 0)", field, "unsupported_value")


class ResponseStore:
    """The stored responses of one deployment (``key_prefix``); see the module docstring."""

    def __init__(self, redis: aioredis.Redis, *, key_prefix: str, ttl_s: float = DEFAULT_TTL_S,
                 max_per_key: int = DEFAULT_MAX_PER_KEY, max_bytes: int, timeout_s: float,
                 on_failure=lambda: None):
        if ttl_s <= 0 or max_per_key < 1 or max_bytes < 1 or timeout_s <= 0:
            raise ValueError(f"response store: ttl_s, max_per_key, max_bytes and timeout_s must be positive, got "
                             f"{ttl_s}, {max_per_key}, {max_bytes}, {timeout_s}")
        self.redis, self.prefix = redis, f"{key_prefix}:responses"
        self.ttl_s, self.max_per_key, self.max_bytes, self.timeout_s = ttl_s, max_per_key, max_bytes, timeout_s
        self.on_failure = on_failure

    def _index(self, key_id: str) -> str:
        return f"{self.prefix}:{key_id}"

    def _key(self, key_id: str, response_id: str) -> str:
        return f"{self.prefix}:{key_id}:{response_id}"

    async def save(self, key_id: str, response_id: str, stored: StoredResponse) -> bool:
        """Store it (and forget the key's oldest past ``max_per_key``); False where it was not: too
        large, or Redis did not take it in time (logged)."""
        data = _encode(stored)
        if len(data) > self.max_bytes:
            log.warning("response %s not stored: its conversation takes %d bytes, over the store's %d",
                        response_id, len(data), self.max_bytes)
            return False
        index = self._index(key_id)
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.set(self._key(key_id, response_id), data, ex=max(1, round(self.ttl_s)))
                    pipe.zadd(index, {response_id: time.time()})
                    pipe.expire(index, max(1, round(self.ttl_s)))
                    pipe.zrange(index, 0, -self.max_per_key - 1)
                    *_, oldest = await pipe.execute()
                if oldest:  # past the key's bound: its oldest go
                    async with self.redis.pipeline(transaction=True) as pipe:
                        pipe.delete(*(self._key(key_id, old.decode()) for old in oldest))
                        pipe.zrem(index, *oldest)
                        await pipe.execute()
        except (TimeoutError, *UNAVAILABLE_ERRORS, redis.exceptions.RedisError) as exc:
            self.on_failure()
            log.warning("response %s not stored: Redis: %s", response_id, type(exc).__name__)
            return False
        return True

    async def load(self, key_id: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The key's stored response; a 404 (``param`` given: a 400 naming it) where there is none,
        a 503 where Redis does not answer in time."""
        if not RESPONSE_ID_RE.fullmatch(response_id):
            raise not_found(response_id[:64], param)
        try:
            async with asyncio.timeout(self.timeout_s):
                data = await self.redis.get(self._key(key_id, response_id))
        except (TimeoutError, *UNAVAILABLE_ERRORS, redis.exceptions.RedisError):
            self.on_failure()
            raise OpenAIError(503, "stored responses are unavailable (Redis does not answer)") from None
        if data is None:
            raise not_found(response_id, param)
        try:
            return _decode(data)
        except msgspec.DecodeError:  # (a ValidationError is one)
            log.warning("stored response %s is unreadable; treated as absent", response_id)
            raise not_found(response_id, param) from None

    async def delete(self, key_id: str, response_id: str) -> None:
        """Forget it; a 404 where the key has none by that id, a 503 where Redis does not answer."""
        if not RESPONSE_ID_RE.fullmatch(response_id):
            raise not_found(response_id[:64])
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.delete(self._key(key_id, response_id))
                    pipe.zrem(self._index(key_id), response_id)
                    deleted, _ = await pipe.execute()
        except (TimeoutError, *UNAVAILABLE_ERRORS, redis.exceptions.RedisError):
            self.on_failure()
            raise OpenAIError(503, "stored responses are unavailable (Redis does not answer)") from None
        if not deleted:
            raise not_found(response_id)
