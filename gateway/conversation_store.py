"""Conversations of OpenAI's Responses API (``/v1/conversations``), in Redis beside the stored
responses (gateway/response_store.py), whose bounds and calls they share.

A conversation is its metadata and an ordered list of items (gateway/response_items.py's shapes:
messages, function calls and their outputs), each with an id of its own.  Clients add items
(``POST .../items``, or ``items`` when they create it), delete them one by one, and a response
created with ``conversation`` reads them before its own input and adds its input's and output's
items once it has ended (gateway/conversation_routes.py, gateway/responses_endpoints.py).

    {prefix}:responses:{key id}:{conversation id}        HASH   created_at, metadata (JSON), bytes (its items'
                                                                 and metadata's)
    {prefix}:responses:{key id}:{conversation id}:ids    LIST   its item ids, oldest first
    {prefix}:responses:{key id}:{conversation id}:items  HASH   item id -> the item (JSON)

It counts in its API key's index and sizes as a stored response does (one more object of the key's
``max_per_key``, its bytes in the key's ``max_bytes_per_key``; storing past them forgets the key's
least recently written first, never one written after the bounds were read) and is kept the store's
``conversation_ttl_s`` (``--conversations-ttl``, 30 days) after it was last changed.  One conversation
holds at most ``MAX_ITEMS`` items of at most the store's ``max_bytes`` in all; a call adds at most
``MAX_NEW_ITEMS``, and a response whose input and answer would not fit is refused before it is
generated (400, ``conversation_full``).  Every change is one Lua
script or transaction: two responses ending on one conversation add their items one after the other,
never interleaved, and nothing is added to a conversation deleted meanwhile.  Ids are ``conv_`` and
32 random hex digits; each API key reads and changes only its own.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Callable, NamedTuple

import msgspec

from gateway.openai_errors import OpenAIError, invalid
from gateway.openai_protocol import MAX_MESSAGES
from gateway.response_store import CONVERSATION_PREFIX, ResponseStore

CONVERSATION_ID_RE = re.compile(CONVERSATION_PREFIX + r"[0-9a-f]{32}")
ITEM_ID_RE = re.compile(r"[a-z]{2,3}_[0-9a-f]{32}")
MAX_ITEMS = MAX_MESSAGES  # a conversation's items: a response reads them all as messages
MAX_NEW_ITEMS = 20  # items a call adds (OpenAI's bound)
PAGE_READS = 3  # reads of a page at most, where its items were deleted between its ids' read and theirs
FIELDS = ("created_at", "metadata")

# Each script's KEYS: the conversation, its ids, its items, the key's index and sizes; its ARGV: its TTL,
# the index's, now, the conversation's id, then its own.  A change renews the TTLs and makes it the key's newest (its
# score past any it had, whatever the gateways' clocks: the eviction keeps what was written since).
_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local function touch(bytes)
  for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ARGV[i < 4 and 1 or 2]) end
  local now, was = tonumber(ARGV[3]), redis.call('ZSCORE', KEYS[4], ARGV[4])
  if was and tonumber(was) >= now then now = tonumber(was) + 0.001 end  -- (later than any score read before)
  redis.call('ZADD', KEYS[4], string.format('%.6f', now), ARGV[4])
  redis.call('HSET', KEYS[5], ARGV[4], bytes)
end
"""
# ARGV: ..., max items, max bytes, then item id and item pairs.  Returns its bytes after; -1 where it is
# gone, -2 / -3 where the items would pass its bound on items / bytes.
_APPEND = _TOUCH + """
local n = (#ARGV - 6) / 2
if redis.call('LLEN', KEYS[2]) + n > tonumber(ARGV[5]) then return -2 end
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
for i = 8, #ARGV, 2 do bytes = bytes + string.len(ARGV[i]) end
if bytes > tonumber(ARGV[6]) then return -3 end
for i = 7, #ARGV, 2 do
  redis.call('RPUSH', KEYS[2], ARGV[i])
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'bytes', bytes)
touch(bytes)
return bytes
"""
# ARGV: ..., an item id.  Returns its created_at and metadata; -1 where it is gone, -2 where it holds no
# such item.
_DELETE_ITEM = _TOUCH + """
local item = redis.call('HGET', KEYS[3], ARGV[5])
if not item then return -2 end
redis.call('LREM', KEYS[2], 1, ARGV[5])
redis.call('HDEL', KEYS[3], ARGV[5])
touch(redis.call('HINCRBY', KEYS[1], 'bytes', -string.len(item)))
return redis.call('HMGET', KEYS[1], 'created_at', 'metadata')
"""
# ARGV: ..., its new metadata (JSON; its bytes count), max bytes.  Returns its created_at and metadata; -1
# where it is gone, -3 where the metadata would pass its bound on bytes.
_UPDATE = _TOUCH + """
local old = redis.call('HGET', KEYS[1], 'metadata') or ''
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0') + string.len(ARGV[5]) - string.len(old)
if bytes > tonumber(ARGV[6]) then return -3 end
redis.call('HSET', KEYS[1], 'metadata', ARGV[5], 'bytes', bytes)
touch(bytes)
return redis.call('HMGET', KEYS[1], 'created_at', 'metadata')
"""


class Held(NamedTuple):
    """A conversation's items (their JSON, oldest first) and its bytes (its items' and metadata's)."""

    items: list[bytes]
    size: int


class Conversation(msgspec.Struct):
    """A conversation as the API answers it."""

    id: str
    created_at: int
    metadata: dict[str, str]
    object: str = "conversation"


class ConversationDeleted(msgspec.Struct):
    """The answer to ``DELETE /v1/conversations/{conversation_id}``."""

    id: str
    object: str = "conversation.deleted"
    deleted: bool = True


def new_conversation_id() -> str:
    return f"{CONVERSATION_PREFIX}{uuid.uuid4().hex}"


def conversation_not_found(param: str | None = None) -> OpenAIError:
    """No conversation by that id (for this API key): a 404 (naming ``param``: the request's field)."""
    return OpenAIError(404, "No conversation has that id.", param=param,
                       code="conversation_not_found" if param else None)


def item_not_found() -> OpenAIError:
    return OpenAIError(404, "The conversation holds no item with that id.", param="item_id")


class ConversationStore:
    """An API key's conversations (see the module docstring), in ``store``'s Redis and bounds."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._append = store.redis.register_script(_APPEND)
        self._delete_item = store.redis.register_script(_DELETE_ITEM)
        self._update = store.redis.register_script(_UPDATE)

    def keys(self, key_id: str, conversation_id: str) -> list[str]:
        """A conversation's keys: itself, its item ids, its items."""
        return self.store.parts(key_id, conversation_id)

    def _checked_keys(self, key_id: str, conversation_id: str, param: str | None) -> list[str]:
        if not CONVERSATION_ID_RE.fullmatch(conversation_id):
            raise conversation_not_found(param)
        return self.keys(key_id, conversation_id)

    async def _change(self, script, key_id: str, conversation_id: str, args: list, param: str | None = None):
        """Run a change's script (``_TOUCH``'s keys and first arguments, then ``args``); a 404 (naming
        ``param``) where the conversation is gone, a 503 where Redis does not answer."""
        store = self.store
        keys = [*self._checked_keys(key_id, conversation_id, param), store.index_key(key_id), store.sizes_key(key_id)]
        async with store.call():
            answer = await script(keys=keys, args=[store.conversation_ttl_s, store.index_ttl_s, time.time(),
                                                   conversation_id, *args])
        if answer == -1:
            raise conversation_not_found(param)
        return answer

    async def create(self, key_id: str, metadata: dict[str, str], items: list[dict[str, Any]]) -> Conversation:
        """A new conversation holding ``items`` (each with its id); a 400 where they pass its bound
        on bytes, a 503 where Redis does not answer."""
        conversation = Conversation(new_conversation_id(), int(time.time()), metadata)
        encoded = [msgspec.json.encode(item) for item in items]
        metadata_json = json.dumps(metadata)
        size = sum(len(e) for e in encoded) + len(metadata_json)
        if size > self.store.max_bytes:
            raise invalid(f"these items take {size} bytes; a conversation holds at most {self.store.max_bytes}",
                          "items")
        store, (meta, ids, held) = self.store, self.keys(key_id, conversation.id)
        async with store.call(), store.redis.pipeline(transaction=True) as pipe:
            pipe.hset(meta, mapping={"created_at": conversation.created_at, "bytes": size,
                                     "metadata": metadata_json})
            pipe.expire(meta, store.conversation_ttl_s)
            if items:
                pipe.rpush(ids, *(item["id"] for item in items))
                pipe.hset(held, mapping={item["id"]: e for item, e in zip(items, encoded)})
                pipe.expire(ids, store.conversation_ttl_s)
                pipe.expire(held, store.conversation_ttl_s)
            store.count(pipe, key_id, conversation.id, size)
            *_, index, sizes = await pipe.execute()
        await store.forget_past_bounds(key_id, index, sizes)
        return conversation

    def check_room(self, held: "Held", adding: list[dict[str, Any]]) -> None:
        """A 400 naming ``conversation`` (code ``conversation_full``) where a conversation holding
        ``held`` has no room for ``adding`` and an answer's item (an answer longer than the room its
        bytes leave is answered, not added: logged)."""
        size = held.size + sum(len(msgspec.json.encode(item)) for item in adding)
        if len(held.items) + len(adding) + 1 > MAX_ITEMS or size > self.store.max_bytes:
            raise invalid(f"the conversation holds {len(held.items)} items; this response's would pass the {MAX_ITEMS} "
                          f"items or {self.store.max_bytes} bytes it may hold (start another, or delete items)",
                          "conversation", "conversation_full")

    async def retrieve(self, key_id: str, conversation_id: str, param: str | None = None) -> Conversation:
        """The conversation; a 404 (naming ``param``) where the key has none by that id."""
        meta = self._checked_keys(key_id, conversation_id, param)[0]
        async with self.store.call():
            fields = await self.store.redis.hmget(meta, *FIELDS)
        return self._conversation(conversation_id, fields, param)

    async def update(self, key_id: str, conversation_id: str, metadata: dict[str, str]) -> Conversation:
        """The conversation with ``metadata`` in place of its own; a 400 where that would pass its
        bound on bytes."""
        fields = await self._change(self._update, key_id, conversation_id, [json.dumps(metadata), self.store.max_bytes])
        if fields == -3:
            raise invalid(f"this metadata would pass the {self.store.max_bytes} bytes a conversation holds", "metadata")
        await self.store.keep_bounds(key_id)
        return self._conversation(conversation_id, fields)

    async def delete(self, key_id: str, conversation_id: str) -> None:
        """Forget it and its items; a 404 where the key has none by that id."""
        self._checked_keys(key_id, conversation_id, None)
        if not await self.store.remove(key_id, conversation_id):
            raise conversation_not_found()

    async def append(self, key_id: str, conversation_id: str, items: list[dict[str, Any]],
                     param: str | None = None) -> None:
        """Add ``items`` (each with its id) after its others, at once; a 404 where it is gone, a 400
        (naming ``param``) where they would pass its bounds, a 503 where Redis does not answer."""
        store, args = self.store, [MAX_ITEMS, self.store.max_bytes]
        for item in items:
            args += [item["id"], msgspec.json.encode(item)]
        held = await self._change(self._append, key_id, conversation_id, args, param)
        if held == -2:
            raise invalid(f"a conversation holds at most {MAX_ITEMS} items; these {len(items)} would pass that",
                          param or "items")
        if held == -3:
            raise invalid(f"these items would pass the {store.max_bytes} bytes a conversation holds",
                          param or "items")
        await store.keep_bounds(key_id)

    async def item_ids(self, key_id: str, conversation_id: str) -> list[str]:
        """Its item ids, oldest first; a 404 where the key has no such conversation."""
        meta, ids, _ = self._checked_keys(key_id, conversation_id, None)
        async with self.store.call(), self.store.redis.pipeline(transaction=True) as pipe:
            pipe.exists(meta)
            pipe.lrange(ids, 0, -1)
            exists, listed = await pipe.execute()
        if not exists:
            raise conversation_not_found()
        return [i.decode() for i in listed]

    async def items(self, key_id: str, conversation_id: str, param: str | None = None) -> "Held":
        """Its items' JSON, oldest first, and its bytes; a 404 (naming ``param``) where the key has no
        such conversation."""
        meta, ids, held = self._checked_keys(key_id, conversation_id, param)
        async with self.store.call(), self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hget(meta, "bytes")
            pipe.lrange(ids, 0, -1)
            pipe.hgetall(held)
            size, order, found = await pipe.execute()
        if size is None:
            raise conversation_not_found(param)
        try:
            size = int(size)
        except ValueError:
            size = self.store.max_bytes  # (unreadable: taken as full)
        return Held([found[i] for i in order if i in found], size)

    async def page(self, key_id: str, conversation_id: str,
                   choose: Callable[[list[str]], tuple[list[str], bool]]) -> tuple[list[bytes], bool]:
        """The JSON of the items that ``choose`` picks from its item ids (oldest first), and whether
        ``choose`` says more follow them; read again (``PAGE_READS`` times at most) where one of them was
        deleted between the two reads, so a page is not shortened by a deletion racing it."""
        for _ in range(PAGE_READS):
            chosen, more = choose(await self.item_ids(key_id, conversation_id))
            found = await self.items_by_id(key_id, conversation_id, chosen)
            if len(found) == len(chosen):
                break
        return found, more

    async def items_by_id(self, key_id: str, conversation_id: str, item_ids: list[str]) -> list[bytes]:
        """The JSON of those of ``item_ids`` it still holds, in that order."""
        if not item_ids:
            return []
        held = self.keys(key_id, conversation_id)[2]
        async with self.store.call():
            found = await self.store.redis.hmget(held, *item_ids)
        return [f for f in found if f is not None]

    async def item(self, key_id: str, conversation_id: str, item_id: str) -> bytes:
        """One item's JSON; a 404 where the conversation or the item is not there."""
        meta, _, held = self._checked_keys(key_id, conversation_id, None)
        if not ITEM_ID_RE.fullmatch(item_id):
            raise item_not_found()
        async with self.store.call(), self.store.redis.pipeline(transaction=True) as pipe:
            pipe.exists(meta)
            pipe.hget(held, item_id)
            exists, found = await pipe.execute()
        if not exists:
            raise conversation_not_found()
        if found is None:
            raise item_not_found()
        return found

    async def delete_item(self, key_id: str, conversation_id: str, item_id: str) -> Conversation:
        """The conversation without that item."""
        self._checked_keys(key_id, conversation_id, None)
        if not ITEM_ID_RE.fullmatch(item_id):
            raise item_not_found()
        fields = await self._change(self._delete_item, key_id, conversation_id, [item_id])
        if fields == -2:
            raise item_not_found()
        return self._conversation(conversation_id, fields)

    @staticmethod
    def _conversation(conversation_id: str, fields, param: str | None = None) -> Conversation:
        """The conversation from its stored ``created_at`` and ``metadata`` (decoded into their
        types, never trusted as given); a 404 where there are none."""
        if not isinstance(fields, list) or fields[0] is None:
            raise conversation_not_found(param)
        try:
            metadata = msgspec.json.decode(fields[1] or b"{}", type=dict[str, str])
            return Conversation(conversation_id, int(fields[0]), metadata)
        except (msgspec.DecodeError, ValueError):
            raise conversation_not_found(param) from None

