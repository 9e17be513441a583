"""Wire messages of the KV block shipping protocol (msgspec/msgpack, bounded; never pickle).

One transfer, prefill worker P (sender) -> decode worker D (receiver)::

    D (receiver)                                   P (sender)
    ------------                                   ----------
    reserve dst blocks [7, 8, 9, 12]
    rx = expect("req-1", [7, 8, 9, 12])  --ids via gateway-->  tx = begin("req-1", D.address)
                                                   |  (connection cached; on first connect:)
            <-------- Hello(layout, version) ------+
            --------- Welcome / Reject(field) ---->   mismatch: HandshakeError, nothing sent
                                                   |  chunk 1 done: send_blocks([3,4], [7,8])
            <-- Blocks(req-1, dst 7, n=2, nbytes) -+   header ...
            <== 2 * block_nbytes raw bytes =======+   ... then payload straight from the cache
                                                   |  chunk 2 done: send_blocks([5,9], [9,12])
            <-- Blocks(req-1, dst 9, n=1) + bytes -+   (split where src or dst ids break)
            <-- Blocks(req-1, dst 12, n=1) + bytes +
            <-- Done(req-1, metadata) -------------+   finish({"first_token": [42]})
    all reserved ids filled -> rx resolves
            --- Ack(req-1) ----------------------->   finish() returns; src blocks unpinned

    Either side, any time:  Abort(req-1, reason) ---> the other side fails that transfer only.
    Deadlines: D fails rx after transfer_timeout; P fails tx if no Ack within lease_timeout.

Bounds: a header is at most ``MAX_HEADER_BYTES``; a ``Blocks`` header covers at most
``MAX_BLOCKS_PER_FRAME`` blocks and its ``nbytes`` must equal ``count * block_nbytes`` of the
receiver's layout and land inside the reserved ids, or the payload is not accepted.
"""
from __future__ import annotations

from typing import Annotated, Union

import msgspec

from common.engine.kv_cache import KVLayout
from kvtransfer.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_BLOCKS_PER_FRAME = 1024
MAX_METADATA_BYTES = 16 * 1024

TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=1024)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
MetaValue = Union[int, float, str, bool, None, Annotated[list[int], msgspec.Meta(max_length=1024)]]
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], MetaValue], msgspec.Meta(max_length=64)]


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver, first frame on a connection."""

    layout: KVLayout
    version: int = PROTOCOL_VERSION
    checksum: bool = False


class Welcome(msgspec.Struct, tag=True, frozen=True):
    """Receiver accepts; ``checksum`` is true if either side asked for per-block checksums."""

    checksum: bool = False


class Reject(msgspec.Struct, tag=True, frozen=True):
    reason: Reason


class Blocks(msgspec.Struct, tag=True, frozen=True):
    """Announces ``nbytes`` raw payload bytes for dst blocks ``first_block_id .. +count-1``."""

    transfer_id: TransferId
    first_block_id: BlockId
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS_PER_FRAME)]
    nbytes: Annotated[int, msgspec.Meta(ge=1)]
    checksums: Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_FRAME)] | None = None


class Done(msgspec.Struct, tag=True, frozen=True):
    """Last frame of a transfer; carries small metadata such as the first sampled token."""

    transfer_id: TransferId
    metadata: Metadata = {}


class Ack(msgspec.Struct, tag=True, frozen=True):
    transfer_id: TransferId


class Abort(msgspec.Struct, tag=True, frozen=True):
    transfer_id: TransferId
    reason: Reason = ""


Message = Union[Hello, Welcome, Reject, Blocks, Done, Ack, Abort]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    data = _encoder.encode(msg)
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"{type(msg).__name__} encodes to {len(data)} bytes > {MAX_HEADER_BYTES}")
    return data


def decode(data: bytes | memoryview) -> Message:
    """Decode one header; anything malformed or out of bounds is a ``ProtocolError``."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed header: {exc}") from None


def check_metadata(metadata: dict) -> dict:
    """Validate ``Done`` metadata on the sending side so a bad value fails before it is sent."""
    try:
        metadata = msgspec.convert(metadata, Metadata)
    except msgspec.ValidationError as exc:
        raise ValueError(f"transfer metadata: {exc}") from None
    size = len(_encoder.encode(metadata))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"transfer metadata encodes to {size} bytes > {MAX_METADATA_BYTES}")
    return metadata
