"""Decode side: accept senders, land their blocks in reserved cache blocks, report each transfer once.

The engine owns the blocks. It reserves destination ids, calls ``expect`` before handing the ids
and the handle's ``transfer_id`` (random, unguessable) to the sender, and awaits the handle:
success gives the ``Done`` metadata; any failure (deadline, peer lost, abort either way,
checksum, bad frame) raises a ``TransferError``, and only once no more bytes can land in those
blocks, so the caller may free them as soon as the handle has resolved (``IncomingTransfer``
spells the contract out).

With tensor parallelism (``KVShards``) the blocks are those of every rank's cache: a frame names
the rank and the heads it carries, and a transfer is complete once every head of every reserved
block of every rank has arrived.  A frame with part of a rank's heads lands in a staging buffer
first (bounded by ``MAX_STAGING_BYTES``) and is copied into place only if the transfer still wants it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time

import msgspec
import torch

from common.cluster.auth import ClusterAuth
from common.engine.kv.kv_cache import KVCache
from common.engine.kv.kv_shards import KVShards
from kvtransfer.config import KVTransferConfig
from kvtransfer.errors import (
    ChecksumMismatch, ConnectionLost, HandshakeError, PeerLost, ProtocolError, TransferAborted,
    TransferError, TransferTimeout,
)
from kvtransfer.handshake import server_handshake
from kvtransfer.messages import (
    MAX_STAGING_BYTES, Abort, Ack, Blocks, Done, Message, decode, encode, new_transfer_id,
)
from kvtransfer.regions import block_checksums
from kvtransfer.transport_base import Channel, Listener, Transport, byte_view
from kvtransfer.transports import make_transport

log = logging.getLogger(__name__)

_RECENTLY_ENDED = 4096  # ids remembered after they end, to tell late senders why
_UNAUTHENTICATED_LOG_PERIOD_S = 60.0  # connections that never authenticated: a warning at most this often


class TransferResult(msgspec.Struct, frozen=True):
    transfer_id: str
    metadata: dict
    nbytes: int
    seconds: float


class IncomingTransfer:
    """One expected transfer into reserved destination blocks.

    The contract the decode worker relies on before it frees or reuses the blocks::

        rx = receiver.expect(request_id, block_ids)
        ... tell the sender rx.transfer_id and block_ids ...
        rx.abort("client left")          # or a deadline, a peer abort, a lost connection ...
        await rx.settled()               # from here on, not one byte lands in block_ids ...
        if rx.still_landing: await it    # ... but where a frozen sender's UCX payload may (below)
        free(block_ids)

    * ``await wait()`` gives the ``TransferResult`` or raises a ``TransferError``; every waiter
      sees the same outcome.
    * The handle resolves, either way, only once no more bytes can land in its blocks (but for
      ``still_landing``, the last point). A payload
      that is landing when the transfer fails is diverted where the transport can stop it at once
      (TCP, inproc: the rest is read and dropped, the connection goes on serving others). Where it
      cannot (UCX moves the bytes without the event loop), the handle waits for that payload to
      end, and after ``abort_grace`` seconds closes the connection, which ends it.
    * So ``settled()`` returns within ``abort_grace`` (plus scheduling) of a failure, and a
      transfer's failure, abort or timeout never touches another transfer on the same connection
      unless its payload had to be stopped by closing that connection.
    * Closing the connection does not stop a UCX payload that its sender froze in the middle of
      (UCX ends such a receive only when the sender completes or fails). The handle then resolves
      all the same, within ``abort_grace`` plus the transport's own bound, with ``still_landing``
      set: a future that ends once nothing more can land. Until it ends the blocks must stay out of
      use (the decode worker keeps them pinned: ``decode_svc.generate.release_reservation``).
    """

    def __init__(self, receiver: "KVReceiver", request_id: str, block_ids: list[int], timeout: float):
        self.request_id = request_id  # for logs; the wire knows the transfer only by transfer_id
        self.transfer_id = new_transfer_id()
        self.block_ids = list(block_ids)
        self.nbytes = 0
        self._reserved = frozenset(self.block_ids)
        # (rank, block id) -> bit mask of that rank's heads still to come for the block
        self._missing = {(rank, block): (1 << (stop - start)) - 1
                         for rank, (start, stop) in enumerate(receiver.shards.head_ranges) for block in self.block_ids}
        self._receiver = receiver
        self._conn: _SenderConnection | None = None
        self._landing: Channel | None = None  # the channel writing a payload into our blocks now
        self._error: TransferError | None = None
        self._started = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future[TransferResult] = self._loop.create_future()
        self._future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        self._timer = self._loop.call_later(timeout, self._on_deadline, timeout)
        self._grace_timer: asyncio.TimerHandle | None = None
        self._still_landing: asyncio.Future | None = None

    @property
    def still_landing(self) -> asyncio.Future | None:
        """A payload the transport could not stop, while it may still land in the blocks (the class
        docstring); ``None`` once it has ended, or if there was none."""
        future = self._still_landing
        return None if future is None or future.done() else future

    async def wait(self) -> TransferResult:
        return await asyncio.shield(self._future)

    async def settled(self) -> None:
        """Return once the handle has resolved (either way); never raises ``TransferError``."""
        await asyncio.wait((self._future,))

    def done(self) -> bool:
        return self._future.done()

    @property
    def active(self) -> bool:
        """Still expecting bytes: not failed, not completed."""
        return self._error is None and not self._future.done()

    @property
    def landing(self) -> bool:
        """A payload is being written into this transfer's blocks right now."""
        return self._landing is not None

    def abort(self, reason: str = "") -> None:
        """Fail the transfer here and tell its sender; ``await settled()`` (and ``still_landing``)
        before freeing blocks."""
        if not self.active:
            return
        conn = self._conn
        self.fail(TransferAborted(f"aborted by receiver: {reason}" if reason else "aborted by receiver"))
        if conn is not None:
            conn.notify(Abort(self.transfer_id, f"aborted by receiver: {reason}"[:1024]))

    def fail(self, error: TransferError) -> None:
        """Mark failed; resolved as soon as no payload can land in the blocks any more."""
        if not self.active:
            return
        self._error = error
        self._receiver._forget(self, str(error))
        channel = self._landing
        if channel is None or channel.divert_payload():
            self._resolve()
        else:
            grace = self._receiver.config.abort_grace
            self._grace_timer = self._loop.call_later(grace, self._stop_landing, channel, grace)

    def _stop_landing(self, channel: Channel, grace: float) -> None:
        if self._landing is channel:
            log.warning("kv receiver: transfer %r failed but its payload was still landing after %ss; "
                        "closing that sender connection to stop it", self.request_id, grace)
            channel.close()

    def _resolve(self) -> None:
        self._timer.cancel()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        if not self._future.done():
            self._future.set_exception(self._error)

    def _succeed(self, metadata: dict) -> None:
        self._timer.cancel()
        self._receiver._forget(self, "completed")
        self._future.set_result(TransferResult(self.transfer_id, metadata, self.nbytes, time.monotonic() - self._started))

    def _landing_started(self, channel: Channel) -> None:
        self._landing = channel

    def _landing_ended(self, still_landing: asyncio.Future | None) -> None:
        self._landing = None
        if still_landing is not None:
            log.warning("kv receiver: transfer %r ended with its payload still landing (its sender froze "
                        "mid-payload); its %d blocks stay out of use until it ends",
                        self.request_id, len(self.block_ids))
            self._still_landing = still_landing
        if self._error is not None:
            self._resolve()

    def _on_deadline(self, timeout: float) -> None:
        if not self.active:
            return
        missing = len({block for _rank, block in self._missing})
        conn = self._conn
        self.fail(TransferTimeout(f"transfer of {self.request_id!r} incomplete after {timeout}s "
                                  f"({missing} of {len(self.block_ids)} blocks missing)"))
        if conn is not None:
            conn.notify(Abort(self.transfer_id, "receiver deadline passed"))


class _SenderConnection:
    """Receiver's view of one connected sender."""

    def __init__(self, channel: Channel, receiver: "KVReceiver"):
        self.channel = channel
        self.checksum = False
        self.transfers: set[IncomingTransfer] = set()
        self._receiver = receiver

    def notify(self, msg: Message) -> None:
        self._receiver._spawn(self._send_quietly(msg))

    async def _send_quietly(self, msg: Message) -> None:
        try:
            await self.channel.send(encode(msg))
        except ConnectionLost:
            pass


class KVReceiver:
    """Listens for prefill workers and writes their KV straight into ``cache``.

    ``await start()`` then ``expect(...)`` per request; ``abort(...)`` also tells the sender.
    Only senders that prove they hold the cluster secret (``auth``) get past the handshake.
    """

    def __init__(self, cache: KVCache | KVShards, config: KVTransferConfig, transport: Transport | None = None,
                 auth: ClusterAuth | None = None):
        self.shards = cache if isinstance(cache, KVShards) else KVShards.single(cache)
        self.config = config
        self.auth = auth or ClusterAuth.disabled()
        self._owns_transport = transport is None
        self.transport = transport or make_transport(config.transport, config)
        self._transfers: dict[str, IncomingTransfer] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._conns: set[_SenderConnection] = set()
        self._serving: set[asyncio.Task] = set()  # one per connection (see _serve)
        self._tasks: set[asyncio.Task] = set()
        self._listener: Listener | None = None
        self.unauthenticated_ended = 0  # connections that ended before authenticating (strangers' too)
        self._unauthenticated_unlogged = 0  # of those, since the last warning about them
        self._unauthenticated_warned_at = -math.inf

    @property
    def cache(self) -> KVCache:
        """This process's own cache (rank 0's, with tensor parallelism)."""
        return self.shards.caches[0]

    async def start(self) -> str:
        self._listener = await self.transport.listen(self.config.host, self.config.port, self._serve)
        log.info("kv receiver listening on %s (%s)", self._listener.address, self.transport.name)
        return self._listener.address

    @property
    def address(self) -> str:
        assert self._listener is not None, "KVReceiver.start() first"
        return self._listener.address

    def expect(self, request_id: str, block_ids: list[int], timeout: float | None = None) -> IncomingTransfer:
        """Register reserved destination ``block_ids`` under a fresh random ``transfer_id``; must
        be called before the sender is told the id and the blocks. ``request_id`` names the
        transfer in logs and errors only."""
        bad = [b for b in block_ids if not 0 <= b < self.shards.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside the {self.shards.num_blocks}-block cache")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("duplicate destination block ids")
        handle = IncomingTransfer(self, request_id, block_ids, timeout or self.config.transfer_timeout)
        self._transfers[handle.transfer_id] = handle
        return handle

    def abort(self, transfer_id: str, reason: str = "") -> IncomingTransfer | None:
        """Fail the transfer locally and tell its sender; ``None`` if it is not in flight.

        Returns the handle: ``await handle.settled()`` (and ``still_landing``) before freeing its
        blocks (see ``IncomingTransfer``)."""
        handle = self._transfers.get(transfer_id)
        if handle is None:
            return None
        handle.abort(reason)
        return handle

    @property
    def num_pending(self) -> int:
        return len(self._transfers)

    async def close(self) -> None:
        """Fail what is still pending and let it settle, flush queued Acks/Aborts (both bounded),
        then drop connections."""
        pending = list(self._transfers.values())
        for handle in pending:
            handle.fail(TransferAborted("receiver closed"))
        if pending:
            await asyncio.wait([h._future for h in pending], timeout=self.config.abort_grace + 1.0)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.connect_timeout)
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns):
            conn.channel.close()  # each connection's handler ends with it
        if self._serving:
            await asyncio.wait(list(self._serving), timeout=self.config.connect_timeout)
        for task in [*self._tasks, *self._serving]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._serving, return_exceptions=True)
        if self._owns_transport:
            self.transport.close()

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, handle: IncomingTransfer, why: str) -> None:
        if self._transfers.get(handle.transfer_id) is handle:
            del self._transfers[handle.transfer_id]
        if handle._conn is not None:
            handle._conn.transfers.discard(handle)
        self._ended[handle.transfer_id] = why
        while len(self._ended) > _RECENTLY_ENDED:
            self._ended.popitem(last=False)

    async def _serve(self, channel: Channel) -> None:
        conn = _SenderConnection(channel, self)
        self._conns.add(conn)
        task = asyncio.current_task()
        self._serving.add(task)
        reason = "connection closed"
        authenticated = False
        try:
            conn.checksum, sender_ranges = await server_handshake(channel, self.shards, self.config.checksum,
                                                                  self.config.connect_timeout, self.auth)
            authenticated = True
            log.info("kv sender connected: %s (%d ranks there, %d here)", channel.description, len(sender_ranges),
                     self.shards.num_ranks)
            while True:
                await self._dispatch(conn, decode(await channel.recv_header()))
        except HandshakeError as exc:
            reason = f"handshake failed: {exc}"
            self._ended_unauthenticated(reason)
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
            if authenticated:
                log.warning("kv receiver: dropping sender connection, %s", exc)
            else:
                self._ended_unauthenticated(reason)
        except ConnectionLost as exc:
            reason = str(exc)
            if authenticated:
                log.info("kv receiver: sender connection lost: %s", exc)
            else:
                self._ended_unauthenticated(reason)
        except asyncio.CancelledError:
            reason = "receiver closed"
            raise
        except Exception:  # a bug must not take the worker down; it ends this connection only
            reason = "internal error"
            log.exception("kv receiver: unexpected error on a sender connection")
        finally:
            channel.close()
            self._conns.discard(conn)
            self._serving.discard(task)
            for handle in list(conn.transfers):
                handle.fail(PeerLost(f"transfer of {handle.request_id!r}: sender connection lost ({reason})"))

    def _ended_unauthenticated(self, reason: str) -> None:
        """A connection that never authenticated is counted, and logged as a warning at most once
        every ``_UNAUTHENTICATED_LOG_PERIOD_S`` (a stranger could otherwise fill the log: a line a
        connection)."""
        self.unauthenticated_ended += 1
        self._unauthenticated_unlogged += 1
        log.debug("kv receiver: a connection ended before authenticating: %s", reason)
        now = time.monotonic()
        if now - self._unauthenticated_warned_at >= _UNAUTHENTICATED_LOG_PERIOD_S:
            log.warning("kv receiver: %d connection(s) ended before authenticating since the last such line "
                        "(the latest: %s)", self._unauthenticated_unlogged, reason)
            self._unauthenticated_unlogged = 0
            self._unauthenticated_warned_at = now

    async def _dispatch(self, conn: _SenderConnection, msg: Message) -> None:
        if isinstance(msg, Blocks):
            await self._on_blocks(conn, msg)
        elif isinstance(msg, Done):
            self._on_done(conn, msg)
        elif isinstance(msg, Abort):
            handle = self._transfers.get(msg.transfer_id)
            if handle is not None and handle._conn in (None, conn):
                handle.fail(TransferAborted(f"aborted by sender: {msg.reason}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from a sender")

    def _claim(self, conn: _SenderConnection, transfer_id: str) -> IncomingTransfer | None:
        """The active transfer this frame belongs to, bound to this connection; else tell the sender."""
        handle = self._transfers.get(transfer_id)
        if handle is None:
            why = self._ended.get(transfer_id, "not expected by this receiver")
            conn.notify(Abort(transfer_id, f"unknown or ended transfer ({why})"[:1024]))
            return None
        if handle._conn is None:
            handle._conn = conn
            conn.transfers.add(handle)
        elif handle._conn is not conn:
            conn.notify(Abort(transfer_id, "transfer is bound to another sender connection"))
            return None
        return handle

    def _reject(self, conn: _SenderConnection, handle: IncomingTransfer, error: TransferError) -> None:
        handle.fail(error)
        conn.notify(Abort(handle.transfer_id, str(error)[:1024]))

    def _piece(self, msg: Blocks) -> tuple[int, int, int]:
        """``(head_start, head_end, nbytes per block)`` of a frame's piece; a header that cannot be
        right (a rank or heads this worker does not have, a size that does not fit them) breaks
        the framing: ``ProtocolError``."""
        shards = self.shards
        if msg.rank >= shards.num_ranks:
            raise ProtocolError(f"Blocks for rank {msg.rank}, but this worker has {shards.num_ranks} ranks")
        start, stop = shards.head_ranges[msg.rank]
        head_start, head_end = msg.heads if msg.heads is not None else (start, stop)
        if not start <= head_start < head_end <= stop:
            raise ProtocolError(f"Blocks for heads [{head_start}, {head_end}) of rank {msg.rank}, which holds [{start}, {stop})")
        per_block = (head_end - head_start) * shards.head_nbytes(msg.rank)
        if msg.nbytes != msg.count * per_block:
            raise ProtocolError(f"Blocks header announces {msg.nbytes} bytes for {msg.count} blocks "
                                f"of {per_block} bytes")
        if (head_start, head_end) != (start, stop) and msg.count > 1 and msg.nbytes > MAX_STAGING_BYTES:
            raise ProtocolError(f"Blocks of part of a rank's heads announce {msg.nbytes} bytes, over the "
                                f"{MAX_STAGING_BYTES} staged at once")
        return head_start, head_end, per_block

    async def _on_blocks(self, conn: _SenderConnection, msg: Blocks) -> None:
        head_start, head_end, per_block = self._piece(msg)
        handle = self._claim(conn, msg.transfer_id)
        if handle is None or not handle.active:
            await conn.channel.discard_payload(msg.nbytes)
            return
        ids = range(msg.first_block_id, msg.first_block_id + msg.count)
        outside = [b for b in ids if b not in handle._reserved]
        if outside:
            await conn.channel.discard_payload(msg.nbytes)
            self._reject(conn, handle, TransferAborted(
                f"sender wrote blocks {outside[:8]} outside the reservation of {handle.request_id!r}"))
            return
        if conn.checksum and (msg.checksums is None or len(msg.checksums) != msg.count):
            await conn.channel.discard_payload(msg.nbytes)
            self._reject(conn, handle, ChecksumMismatch("checksums required but missing or miscounted"))
            return
        view = self.shards.heads_view(msg.rank, msg.first_block_id, msg.count, head_start, head_end)
        whole = view.is_contiguous()
        region = byte_view(view) if whole else torch.empty(msg.nbytes, dtype=torch.uint8, device=view.device)
        handle._landing_started(conn.channel)
        try:
            await conn.channel.recv_payload_into(region)
        finally:
            # into a staging buffer, a payload still landing is harmless: the transport keeps it
            handle._landing_ended(conn.channel.still_landing() if whole else None)
        if not handle.active:
            return  # failed while landing: the rest was diverted, or must not count
        if msg.checksums is not None:
            got = block_checksums(region, per_block)
            bad = [b for b, want, have in zip(ids, msg.checksums, got) if want != have]
            if bad:
                self._reject(conn, handle, ChecksumMismatch(f"checksum mismatch in blocks {bad[:8]}"))
                return
        if not whole:
            view.copy_(region.view(view.dtype).view(view.shape))
            if view.device.type == "cuda":  # another rank's process reads it after the next step's broadcast
                torch.cuda.synchronize(view.device)
        rank_start = self.shards.head_ranges[msg.rank][0]
        arrived = ((1 << (head_end - head_start)) - 1) << (head_start - rank_start)
        missing = handle._missing
        for block in ids:
            key = (msg.rank, block)
            left = missing.get(key, 0) & ~arrived
            if left:
                missing[key] = left
            else:
                missing.pop(key, None)
        handle.nbytes += msg.nbytes

    def _on_done(self, conn: _SenderConnection, msg: Done) -> None:
        handle = self._claim(conn, msg.transfer_id)
        if handle is None or not handle.active:
            return
        if handle._missing:
            self._reject(conn, handle, TransferAborted(
                f"Done before all blocks arrived ({len(handle._missing)} of {len(handle.block_ids)} missing)"))
            return
        handle._succeed(dict(msg.metadata))
        conn.notify(Ack(msg.transfer_id))
