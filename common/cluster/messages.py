"""Wire messages between the gateway and the workers (msgspec msgpack, bounded, never pickle).

    gateway --GenerateRequest--> decode worker --PrefillRequest--> prefill worker
    gateway <--TokenFrame stream-- decode worker <--PrefillResult-- prefill worker
                                   decode worker <==KV blocks (kvtransfer)== prefill worker

A stream is a sequence of frames, each a 4-byte big-endian length and a msgpack body.
"""
from __future__ import annotations

import asyncio

from typing import Annotated, Type, TypeVar

import msgspec

from common.cluster.registry import WorkerId
from common.engine.kv.prefix_hash import MAX_CACHE_SALT_LEN
from common.engine.sampling_params import SamplingParams

MAX_FRAME_BYTES = 4 << 20  # a frame above this is a protocol error, never an allocation
MAX_PROMPT_TOKENS = 1 << 20

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
# A request's prefix-cache salt (``prefix_hash.block_extra_keys``): blocks are shared only between
# requests with the same salt.  Set by the client (``cache_salt``) or by the gateway per API key.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_LEN)]
TokenIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
# The decode worker's receiver names each KV transfer with 128 random bits (kvtransfer.messages).
TransferIdHex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int | None = None  # a scored prompt token's place among all (``TokenLogprobs``)


def wire_logprob(entry) -> TokenLogprob | None:
    """The engine's ``TokenLogprobs`` (``None``: none) as it travels."""
    return None if entry is None else TokenLogprob(entry.token_id, entry.logprob, entry.top, entry.rank)


def wire_logprobs(entries) -> list[TokenLogprob] | None:
    """The engine's ``TokenLogprobs`` entries (``None``: none asked for) as they travel."""
    return None if entries is None else [wire_logprob(e) for e in entries]


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Gateway -> decode worker: generate for this prompt; ``prefill_worker_id`` set means the
    prompt's KV is computed by that prefill worker (the decode worker finds its address in the
    registry itself), otherwise this worker computes it itself."""

    request_id: RequestId
    prompt_token_ids: TokenIds
    sampling_params: SamplingParams
    prefill_worker_id: WorkerId | None = None
    cache_salt: CacheSalt | None = None
    # A stream that moved here from another decode worker (``gateway.migration``): the output
    # tokens the client already has.  This worker continues after them, with the KV of the prompt
    # and these tokens computed here or, with ``prefill_worker_id``, fetched from that worker (the
    # draining worker the stream left, whose cache holds it: ``PrefillRequest.moved_stream_id``).
    resume_token_ids: TokenIds = []
    # The gateway can move this stream on: a draining worker may end it at a token boundary with a
    # "migrate" frame instead of decoding it to the end.
    may_migrate: bool = False
    # A pre-copy (``gateway.migration``): the KV of stream ``precopy_of``, still decoding on the
    # draining worker ``prefill_worker_id``, fetched into this worker's cache ahead of its
    # hand-over (``max_tokens`` ends the request at the fetched token: nothing is decoded here).
    precopy_of: RequestId | None = None
    # A moved stream sent to a draining (or drained) decode worker: no active one was left to take it
    # (``StreamMigration.last_resort``).  Such a worker takes it and decodes it to its end.
    last_resort: bool = False


class TokenFrame(msgspec.Struct, omit_defaults=True):
    """Decode worker -> gateway, one per step that produced tokens (or the final error)."""

    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    # On the first frame of a request with ``prompt_logprobs``: entry i scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prefill_worker: str | None = None  # the prefill worker's id, on the first frame
    # On the first frame of a disaggregated request: the KV that moved, and whether the remote
    # prefill failed and the decode worker computed the prompt itself.
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    prefill_fallback: bool = False
    num_preemptions: int = 0  # on the last frame
    error: str | None = None
    # Nothing was started, try another worker: "busy" (full) or "refused" (draining, or its role
    # changed: the caller's view is stale).  "invalid": bad input.  "failed": it broke mid-way.
    # "migrate": this worker drains and hands the stream over after the tokens sent so far (only
    # for a request that said ``may_migrate``): the gateway continues it on another worker.
    error_kind: str | None = None
    error_param: str | None = None  # an "invalid" error's request field, where it names one (its grammar's)
    # This worker drains: the stream will be handed over soon; the gateway may pre-copy its KV
    # to the worker it will move to meanwhile (a frame with no tokens; ``gateway.migration``).
    move_soon: bool = False


class PrefillRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Decode worker -> prefill worker: compute this prompt and ship its KV blocks
    ``num_skip_blocks..`` into ``dst_block_ids`` of decode worker ``decode_worker_id`` (the prefill
    worker ships to the KV address that worker registered, never to one a caller names), as KV
    transfer ``transfer_id`` (the decode worker's receiver chose it; unguessable)."""

    request_id: RequestId
    prompt_token_ids: TokenIds
    sampling_params: SamplingParams
    decode_worker_id: WorkerId
    dst_block_ids: BlockIds
    transfer_id: TransferIdHex
    num_skip_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    cache_salt: CacheSalt | None = None  # the GenerateRequest's: both workers hash the blocks alike
    # A moved stream (``GenerateRequest.resume_token_ids``): the KV covers the prompt and these
    # output tokens, and the token sampled is the one after them.  ``moved_stream_id``: the
    # stream's request id at the worker it left, when that worker is asked (its drain waits for
    # this call; ``request_id`` is then this call's own).
    resume_token_ids: TokenIds = []
    moved_stream_id: RequestId | None = None


class PrefillResult(msgspec.Struct, omit_defaults=True):
    """Prefill worker -> decode worker: the first token, and what the prefill cost."""

    first_token_id: int | None = None  # None with an error
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with ``prompt_logprobs``: entry i scores prompt token i + 1
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in its own prefix cache
    num_sent_blocks: int = 0
    error: str | None = None


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    request_id: RequestId


_encoder = msgspec.msgpack.Encoder()
T = TypeVar("T")


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind: Type[T]) -> T:
    """Decode and validate; raises ``ValueError`` naming what is wrong."""
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid {kind.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed {kind.__name__}: {exc}") from None


# The content type of a frame stream: a decode worker's /generate answer, stream and error alike.
FRAMES_CONTENT_TYPE = "application/x-pdserve-frames"


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return len(body).to_bytes(4, "big") + body


READ_RESPONSE_TIMEOUT_S = 30.0


async def read_response(response, limit: int = MAX_FRAME_BYTES, timeout: float = READ_RESPONSE_TIMEOUT_S) -> bytes:
    """The whole body of an aiohttp client ``response``, refusing (``ValueError``) one above ``limit``
    bytes before it is buffered: a peer's answer never makes us allocate more than ``limit``.
    The read is bounded by ``timeout`` seconds (``asyncio.TimeoutError``) besides the session's own
    timeouts, so a peer that sends headers and then stalls cannot hold the caller."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise ValueError(f"response of {declared} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    async with asyncio.timeout(timeout):
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise ValueError(f"response exceeds the {limit}-byte limit")
    return bytes(body)


async def read_excerpt(response, limit: int, timeout: float) -> bytes:
    """The first ``limit`` bytes of an aiohttp client ``response``'s body (all of it when shorter),
    read whole up to that limit within ``timeout`` seconds; what arrived before a timeout is
    returned as it is.  For logging an answer that is not what was asked."""
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in response.content.iter_any():
                body += chunk[:limit - len(body)]
                if len(body) >= limit:
                    break
    except TimeoutError:
        pass
    return bytes(body)


async def read_frame(reader, kind: Type[T]) -> T | None:
    """Read one length-prefixed frame from an aiohttp ``StreamReader``; ``None`` at a clean end."""
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("stream cut inside a frame header") from None
        return None
    length = int.from_bytes(header, "big")
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ConnectionError("stream cut inside a frame") from None
    return decode(body, kind)


class FrameReader:
    """Reads a stream of frames (an aiohttp ``StreamReader``), handing out every complete frame
    that has arrived at once: a reader that fell behind catches up in one pass, and its caller
    can answer the whole batch with one write.

    Bounded like ``read_frame``: a header announcing more than ``MAX_FRAME_BYTES`` is a
    ``ValueError`` before anything is buffered for it, and the buffer never holds more than one
    frame plus one network chunk.
    """

    def __init__(self, reader, kind: Type[T]):
        self._reader = reader
        self._kind = kind
        self._buffer = bytearray()

    async def next_batch(self) -> list[T]:
        """The frames that have arrived (at least one), or ``[]`` at a clean end.  Raises
        ``ConnectionError`` when the stream is cut inside a frame, ``ValueError`` for a bad one."""
        while True:
            frames = self._parse()
            if frames:
                return frames
            chunk = await self._reader.readany()
            if not chunk:
                if self._buffer:
                    raise ConnectionError("stream cut inside a frame")
                return []
            self._buffer += chunk

    def _parse(self) -> list[T]:
        buffer, frames, pos = self._buffer, [], 0
        while len(buffer) - pos >= 4:
            length = int.from_bytes(buffer[pos:pos + 4], "big")
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
            if len(buffer) - pos - 4 < length:
                break
            frames.append(decode(bytes(buffer[pos + 4:pos + 4 + length]), self._kind))
            pos += 4 + length
        if pos:
            del buffer[:pos]
        return frames
