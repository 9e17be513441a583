"""Connection handshake: both ends prove they hold the cluster secret, then the KV layouts must match
and the sender's tensor-parallel ranks must hold every kv head the receiver's ranks own.

Nothing else travels on a connection before this has passed: no block is accepted, and (UCX) the
data path -- the receiver's UCX worker address and tag base -- is sent only afterwards::

    S (sender)                                              R (receiver)
    Hello(layout, shards, version, checksum, nonce_s) ---->
                  <------------ Challenge(nonce_r, proof_r)  proof_r = MAC("receiver", hello, nonce_r)
    proof_r wrong: HandshakeError, close (S sends nothing)
    Proof(proof_s) --------------------------------------->  proof_s = MAC("sender", hello, nonce_r)
                  <------- Welcome(checksum, shards)       proof_s wrong: Reject("authentication
                             or Reject(reason)                 failed"), close; layout or version
                                                               mismatch, or heads the sender's
                                                               ranks cannot fill: Reject naming it

``shards`` are each side's ranks' kv head ranges (tensor parallelism, ``kv_shards.py``): the sender
plans its pieces from the receiver's, and the receiver refuses a sender whose ranks do not hold
every head, or whose ranges are not ranges of the model's heads.

``MAC`` is ``ClusterAuth.kv_proof``: HMAC-SHA256 under the KV key derived from the cluster secret,
over length-prefixed parts. ``hello`` is the exact bytes of the Hello frame, so the proofs also
cover the layout, version, checksum flag and the sender's fresh nonce; the role label keeps a
proof from being reflected back at its maker; each side's fresh nonce keeps a recorded exchange
from being replayed. A peer without the secret learns nothing but a Reject. Without a secret
configured (every listener on loopback, see ``common/cluster/auth.py``) the proofs are not checked.

The whole handshake is bounded by ``timeout``; a peer that sends anything out of place (a frame
that is not the expected one) gets no answer and the connection is closed. Until a channel's data
path is open (after ``Welcome``), its transport takes no header longer than
``PREAUTH_MAX_HEADER_BYTES``: whoever has not authenticated makes it hold no more than that.
"""
from __future__ import annotations

import asyncio
import secrets

from common.cluster.auth import ClusterAuth
from common.engine.kv.kv_shards import HeadRange, KVShards, check_head_ranges
from kvtransfer.errors import ConnectionLost, HandshakeError, ProtocolError
from kvtransfer.messages import (
    NONCE_BYTES, PROTOCOL_VERSION, Challenge, Hello, Message, Proof, Reject, Welcome, decode, encode,
)
from kvtransfer.transport_base import Channel

# Every frame before authentication fits (a Hello carries the layout, model id included; a Reject's
# reason is cut to fit); a transport refuses a longer announced header before reading it.
PREAUTH_MAX_HEADER_BYTES = 1024
_REJECT_REASON_BYTES = PREAUTH_MAX_HEADER_BYTES - 64  # room for the Reject's own encoding

_SENDER = b"kv-sender"
_RECEIVER = b"kv-receiver"
AUTH_FAILED = "authentication failed"


def _reject(reason: str) -> bytes:
    return encode(Reject(reason=reason.encode()[:_REJECT_REASON_BYTES].decode(errors="ignore")))


async def _expect(channel: Channel, kind: type[Message]) -> Message:
    msg = decode(await channel.recv_header())
    if isinstance(msg, Reject):
        raise HandshakeError(f"receiver rejected the connection: {msg.reason}")
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


def _ranges(shards: list | None, num_kv_heads: int) -> list[HeadRange]:
    return [(0, num_kv_heads)] if shards is None else [tuple(r) for r in shards]


async def client_handshake(channel: Channel, shards: KVShards, checksum: bool, timeout: float,
                           auth: ClusterAuth | None = None) -> tuple[bool, list[HeadRange]]:
    """Run the sender's side; returns whether per-block checksums are on for this connection, and
    the kv heads of each of the receiver's ranks.

    Raises ``HandshakeError`` if the receiver cannot prove the secret (nothing is sent then),
    rejects this sender, announces ranks this sender cannot fill, or the exchange fails or takes
    longer than ``timeout``."""
    auth = auth or ClusterAuth.disabled()
    layout = shards.layout
    hello = encode(Hello(layout=layout, nonce=secrets.token_bytes(NONCE_BYTES), checksum=checksum,
                         shards=None if shards.num_ranks == 1 else shards.head_ranges))
    if len(hello) > PREAUTH_MAX_HEADER_BYTES:
        raise HandshakeError(f"the Hello frame is {len(hello)} bytes, over the {PREAUTH_MAX_HEADER_BYTES} a receiver "
                             f"reads before authentication (is the model id {len(layout.model_id)} characters long?)")
    try:
        async with asyncio.timeout(timeout):
            await channel.send(hello)
            challenge = await _expect(channel, Challenge)
            if not auth.kv_proof_matches((_RECEIVER, hello, challenge.nonce), challenge.proof):
                raise HandshakeError("the receiver could not prove it holds the cluster secret")
            await channel.send(encode(Proof(auth.kv_proof(_SENDER, hello, challenge.nonce))))
            welcome = await _expect(channel, Welcome)
            receiver_ranges = _ranges(welcome.shards, layout.num_kv_heads)
            problems = check_head_ranges(receiver_ranges, layout.num_kv_heads)
            if problems:
                raise HandshakeError("the receiver's tensor-parallel ranks: " + "; ".join(problems))
            await channel.open_data_path(sender=True, timeout=timeout)
    except TimeoutError:
        raise HandshakeError(f"handshake not completed within {timeout}s") from None
    except (ConnectionLost, ProtocolError) as exc:
        raise HandshakeError(f"handshake failed: {exc}") from None
    return welcome.checksum, receiver_ranges


async def server_handshake(channel: Channel, shards: KVShards, checksum: bool, timeout: float,
                           auth: ClusterAuth | None = None) -> tuple[bool, list[HeadRange]]:
    """Run the receiver's side; returns whether per-block checksums are on for this connection,
    and the kv heads of each of the sender's ranks.

    Raises ``HandshakeError`` (after telling the peer why, when it is a refusal) or
    ``ProtocolError`` (a frame out of place: no answer); the caller closes the channel."""
    auth = auth or ClusterAuth.disabled()
    layout = shards.layout
    try:
        async with asyncio.timeout(timeout):
            hello_bytes = await channel.recv_header()
            hello = decode(hello_bytes)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
            nonce = secrets.token_bytes(NONCE_BYTES)
            await channel.send(encode(Challenge(nonce=nonce, proof=auth.kv_proof(_RECEIVER, hello_bytes, nonce))))
            proof = decode(await channel.recv_header())
            if not isinstance(proof, Proof):
                raise ProtocolError(f"expected Proof, got {type(proof).__name__}")
            if not auth.kv_proof_matches((_SENDER, hello_bytes, nonce), proof.proof):
                await channel.send(_reject(AUTH_FAILED))
                raise HandshakeError("the sender could not prove it holds the cluster secret")
            problems = []
            if hello.version != PROTOCOL_VERSION:
                problems.append(f"protocol version: {hello.version} != {PROTOCOL_VERSION}")
            problems += layout.mismatches(hello.layout)
            if problems:
                reason = "KV layout mismatch (receiver != sender): " + "; ".join(problems)
                await channel.send(_reject(reason))
                raise HandshakeError(reason)
            sender_ranges = _ranges(hello.shards, layout.num_kv_heads)
            problems = check_head_ranges(sender_ranges, layout.num_kv_heads)
            if problems:
                reason = (f"cannot take KV from a sender with {len(sender_ranges)} tensor-parallel ranks holding "
                          f"heads {sender_ranges} into ranks holding {shards.head_ranges}: " + "; ".join(problems))
                await channel.send(_reject(reason))
                raise HandshakeError(reason)
            use_checksum = checksum or hello.checksum
            await channel.send(encode(Welcome(checksum=use_checksum,
                                              shards=None if shards.num_ranks == 1 else shards.head_ranges)))
            await channel.open_data_path(sender=False, timeout=timeout)
    except TimeoutError:
        raise HandshakeError(f"handshake not completed within {timeout}s") from None
    return use_checksum, sender_ranges
