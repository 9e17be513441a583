"""Wire messages of the KV block shipping protocol (msgspec/msgpack, bounded; never pickle).

One transfer, prefill worker P (sender) -> decode worker D (receiver)::

    D (receiver)                                   P (sender)
    ------------                                   ----------
    reserve dst blocks [7, 8, 9, 12]
    rx = expect("req-1", [7, 8, 9, 12])            rx.transfer_id = T: 128 random bits, the only
                                 --T, ids via the signed /prefill call-->  name of this transfer
                                                   tx = begin(T, D.address)
                                                   |  (connection cached; on first connect the
                                                   |   handshake, see handshake.py: both ends prove
                                                   |   the cluster secret, then layouts must match)
                                                   |  chunk 1 done: send_blocks([3,4], [7,8])
            <-- Blocks(T, dst 7, n=2, nbytes) -----+   header ...   (binds T to this connection)
            <== 2 * block_nbytes raw bytes =======+   ... then payload straight from the cache
                                                   |  chunk 2 done: send_blocks([5,9], [9,12])
            <-- Blocks(T, dst 9, n=1) + bytes -----+   (split where src or dst ids break)
            <-- Blocks(T, dst 12, n=1) + bytes ----+
            <-- Done(T, metadata) -----------------+   finish({...}): optional small JSON
    all reserved ids filled -> rx resolves
            --- Ack(T) --------------------------->   finish() returns; src blocks unpinned

    Either side, any time:  Abort(T, reason) ---> the other side fails that transfer only.
    Deadlines: D fails rx after transfer_timeout; P fails tx if no Ack within lease_timeout.

A transfer id is unguessable and, from its first frame on, bound to the authenticated connection
that presented it: the same id on any other connection is refused (``Abort``), its payload dropped.

Bounds: a header is at most ``MAX_HEADER_BYTES``; a ``Blocks`` header covers at most
``MAX_BLOCKS_PER_FRAME`` blocks and its ``nbytes`` must equal ``count * block_nbytes`` of the
receiver's layout and land inside the reserved ids, or the payload is not accepted.
"""
from __future__ import annotations

from typing import Annotated, Union

import secrets

import msgspec

from common.engine.kv.kv_cache import KVLayout
from kvtransfer.errors import ProtocolError

PROTOCOL_VERSION = 3
NONCE_BYTES = 32
TRANSFER_ID_BYTES = 16
MAX_HEADER_BYTES = 64 * 1024
MAX_BLOCKS_PER_FRAME = 1024
MAX_METADATA_BYTES = 16 * 1024
MAX_RANKS = 64
# A piece that is part of a rank's heads is staged (copied) on the way; one frame of it is at most
# this many bytes unless a single block is bigger.
MAX_STAGING_BYTES = 64 << 20

TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=1024)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
MetaValue = Union[int, float, str, bool, None, Annotated[list[int], msgspec.Meta(max_length=1024)]]
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
HeadIndex = Annotated[int, msgspec.Meta(ge=0, lt=2**16)]
HeadRanges = Annotated[list[tuple[HeadIndex, HeadIndex]], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], MetaValue], msgspec.Meta(max_length=64)]


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver, first frame on a connection; ``nonce`` is the sender's challenge.

    ``layout`` is the model's (``num_kv_heads`` counts every head); ``shards`` the kv heads each of
    the sender's tensor-parallel ranks holds, index = rank (None: one rank with every head)."""

    layout: KVLayout
    nonce: Nonce
    version: int = PROTOCOL_VERSION
    checksum: bool = False
    shards: HeadRanges | None = None


class Challenge(msgspec.Struct, tag=True, frozen=True):
    """Receiver -> sender: its own challenge, and its proof of the secret over the sender's Hello."""

    nonce: Nonce
    proof: Mac


class Proof(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver: proof of the secret over the Hello and the receiver's challenge."""

    proof: Mac


class Welcome(msgspec.Struct, tag=True, frozen=True):
    """Receiver accepts (both proofs held, layouts equal, its heads all held by the sender's
    ranks); ``checksum`` is true if either side asked for per-block checksums; ``shards`` are the
    receiver's ranks' kv heads (None: one rank with every head)."""

    checksum: bool = False
    shards: HeadRanges | None = None


class Reject(msgspec.Struct, tag=True, frozen=True):
    reason: Reason


class Blocks(msgspec.Struct, tag=True, frozen=True):
    """Announces ``nbytes`` raw payload bytes for dst blocks ``first_block_id .. +count-1`` of the
    receiver's rank ``rank``: kv heads ``heads`` (model numbering; None: every head that rank
    holds), laid out ``[count, layers, 2, block_size, heads, head_dim]``."""

    transfer_id: TransferId
    first_block_id: BlockId
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS_PER_FRAME)]
    nbytes: Annotated[int, msgspec.Meta(ge=1)]
    checksums: Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_FRAME)] | None = None
    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)] = 0
    heads: tuple[HeadIndex, HeadIndex] | None = None


class Done(msgspec.Struct, tag=True, frozen=True):
    """Last frame of a transfer; carries small metadata such as the first sampled token."""

    transfer_id: TransferId
    metadata: Metadata = {}


class Ack(msgspec.Struct, tag=True, frozen=True):
    transfer_id: TransferId


class Abort(msgspec.Struct, tag=True, frozen=True):
    transfer_id: TransferId
    reason: Reason = ""


Message = Union[Hello, Challenge, Proof, Welcome, Reject, Blocks, Done, Ack, Abort]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def new_transfer_id() -> str:
    """A fresh transfer id: 128 random bits (hex), so nobody can guess one to race its sender."""
    return secrets.token_bytes(TRANSFER_ID_BYTES).hex()


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
