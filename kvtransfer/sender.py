"""Prefill side: ship finished blocks to a decode worker's reserved blocks, chunk by chunk.

``tx = await sender.begin(transfer_id, address)`` (connection cached per address, handshake on
first use), then ``await tx.send_blocks(src_ids, dst_ids)`` whenever a prefill chunk's blocks are
final (the engine thread keeps computing other blocks meanwhile), then ``await tx.finish(meta)``
which returns once the receiver acknowledged, or raises a ``TransferError`` (receiver abort, peer
lost, no ack within the lease). The caller keeps the source blocks pinned until then.

Between workers with tensor parallelism (``KVShards``), each run of blocks goes as one frame per
piece of the connection's plan (``transfer_plan``): every receiving rank gets exactly its heads,
from a rank here that holds them; a piece that is part of a rank's share is copied out first.
"""
from __future__ import annotations

import asyncio
import logging

from common.cluster.auth import ClusterAuth
from common.engine.kv.kv_cache import KVCache
from common.engine.kv.kv_shards import HeadRange, KVShards, Piece, transfer_plan
from kvtransfer.config import KVTransferConfig, parse_address
from kvtransfer.errors import (
    ConnectionLost, PeerLost, ProtocolError, TransferAborted, TransferError, TransferTimeout,
)
from kvtransfer.handshake import client_handshake
from kvtransfer.messages import (
    MAX_BLOCKS_PER_FRAME, MAX_STAGING_BYTES, Abort, Ack, Blocks, Done, check_metadata, decode, encode,
)
from kvtransfer.ordering import Fence, record_fence, wait_for_fence
from kvtransfer.regions import block_checksums, paired_runs
from kvtransfer.transport_base import Channel, Transport, byte_view
from kvtransfer.transports import make_transport

log = logging.getLogger(__name__)


class OutgoingTransfer:
    """One transfer from this worker's cache to a receiver's reserved blocks."""

    def __init__(self, sender: "KVSender", conn: "_ReceiverConnection", transfer_id: str):
        self.transfer_id = transfer_id
        self.nbytes = 0
        self._sender = sender
        self._conn = conn
        self._outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outcome.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def error(self) -> TransferError | None:
        return self._outcome.exception() if self._outcome.done() else None

    def done(self) -> bool:
        return self._outcome.done()

    def _check(self) -> None:
        if self._outcome.done():
            raise self._outcome.exception() or TransferError(f"transfer {self.transfer_id!r} already finished")

    async def send_blocks(self, src_block_ids: list[int], dst_block_ids: list[int], fence: Fence | None = None) -> None:
        """Send the bytes of ``src_block_ids`` into the receiver's ``dst_block_ids`` (same length).

        ``fence``: recorded after the step that wrote these blocks (``ordering.record_fence``);
        nothing of them is read before it has completed (a no-op on CPU)."""
        self._check()
        try:
            await wait_for_fence(fence)
        except asyncio.CancelledError:
            self.abort("sender cancelled")
            raise
        shards, conn = self._sender.shards, self._conn
        for src, dst, count in paired_runs(src_block_ids, dst_block_ids, conn.max_count):
            for piece in conn.plan:
                try:
                    region = await _piece_bytes(shards, piece, src, count)
                except asyncio.CancelledError:
                    self.abort("sender cancelled")  # (as below: the receiver frees its blocks now)
                    raise
                sums = block_checksums(region, region.numel() // count) if conn.checksum else None
                heads = (piece.head_start, piece.head_end)
                if heads == conn.receiver_ranges[piece.dst_rank]:
                    heads = None  # all that rank holds
                header = encode(Blocks(self.transfer_id, dst, count, region.numel(), sums, piece.dst_rank, heads))
                self._check()
                try:
                    await conn.channel.send(header, region)
                except ConnectionLost as exc:
                    self._fail(PeerLost(f"transfer {self.transfer_id!r}: {exc}"))
                    self._check()
                except asyncio.CancelledError:
                    # The channel sent this frame whole or not at all; the receiver must still learn
                    # that no more is coming, so it can free the blocks now instead of at its deadline.
                    self.abort("sender cancelled")
                    raise
                self.nbytes += region.numel()

    async def finish(self, metadata: dict | None = None, lease_timeout: float | None = None) -> None:
        """Send ``Done`` and wait for the receiver's ``Ack`` within the lease."""
        self._check()
        metadata = check_metadata(metadata or {})
        lease = lease_timeout or self._sender.config.lease_timeout
        try:
            await self._conn.channel.send(encode(Done(self.transfer_id, metadata)))
            await asyncio.wait_for(asyncio.shield(self._outcome), lease)
        except ConnectionLost as exc:
            self._fail(PeerLost(f"transfer {self.transfer_id!r}: {exc}"))
            self._check()
        except asyncio.TimeoutError:
            self._fail(TransferTimeout(f"transfer {self.transfer_id!r}: no acknowledgement within {lease}s"))
            self._conn.notify(Abort(self.transfer_id, f"sender lease of {lease}s expired"))
            self._check()
        except asyncio.CancelledError:
            self.abort("sender cancelled")
            raise

    def abort(self, reason: str = "") -> None:
        """Fail this transfer and tell the receiver (best effort)."""
        if self._outcome.done():
            return
        self._fail(TransferAborted(f"aborted by sender: {reason}" if reason else "aborted by sender"))
        self._conn.notify(Abort(self.transfer_id, reason[:1024]))

    def _fail(self, error: TransferError) -> None:
        if not self._outcome.done():
            self._outcome.set_exception(error)
            self._conn.transfers.pop(self.transfer_id, None)

    def _acked(self) -> None:
        if not self._outcome.done():
            self._outcome.set_result(None)
            self._conn.transfers.pop(self.transfer_id, None)


async def _piece_bytes(shards: KVShards, piece: Piece, first_block_id: int, count: int):
    """The bytes of one piece of a block run: a view of the cache where the piece is the sending
    rank's whole share, else a contiguous copy of its heads -- complete before this returns: on
    CUDA the copy is only queued on this thread's stream, and UCX reads device memory on streams of
    its own."""
    view = shards.heads_view(piece.src_rank, first_block_id, count, piece.head_start, piece.head_end)
    if view.is_contiguous():
        return byte_view(view)
    copy = view.contiguous()
    await wait_for_fence(record_fence(copy.device))
    return byte_view(copy)


class _ReceiverConnection:
    """Sender's view of one receiver: the channel, its reader task and the transfers on it, and
    the plan for its ranks: which heads of each block go to which of them (``transfer_plan``)."""

    def __init__(self, sender: "KVSender", address: str, channel: Channel, checksum: bool,
                 receiver_ranges: list[HeadRange]):
        self.address = address
        self.channel = channel
        self.checksum = checksum
        shards = sender.shards
        self.receiver_ranges = [tuple(r) for r in receiver_ranges]
        self.plan = transfer_plan(shards.head_ranges, self.receiver_ranges)
        piece_bytes = [(p.head_end - p.head_start) * shards.head_nbytes(p.src_rank) for p in self.plan]
        partial = [b for p, b in zip(self.plan, piece_bytes)
                   if not shards.is_whole_share(p.src_rank, p.head_start, p.head_end)
                   or self.receiver_ranges[p.dst_rank] != (p.head_start, p.head_end)]
        limits = [MAX_BLOCKS_PER_FRAME, channel.max_payload_nbytes // max(piece_bytes)]
        if partial:  # staged on one side or the other: bounded
            limits.append(MAX_STAGING_BYTES // max(partial))
        self.max_count = max(1, min(limits))
        self.transfers: dict[str, OutgoingTransfer] = {}
        self.alive = True
        self._sender = sender
        self.reader = asyncio.get_running_loop().create_task(self._read())

    def notify(self, msg) -> None:
        self._sender._spawn(self._send_quietly(msg))

    async def _send_quietly(self, msg) -> None:
        try:
            await self.channel.send(encode(msg))
        except ConnectionLost:
            pass

    async def _read(self) -> None:
        reason = "connection closed"
        try:
            while True:
                msg = decode(await self.channel.recv_header())
                tx = self.transfers.get(getattr(msg, "transfer_id", ""))
                if isinstance(msg, Ack):
                    if tx is not None:
                        tx._acked()
                elif isinstance(msg, Abort):
                    if tx is not None:
                        tx._fail(TransferAborted(f"transfer {msg.transfer_id!r} aborted by receiver: {msg.reason}"))
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a receiver")
        except (ConnectionLost, ProtocolError) as exc:
            reason = str(exc)
            log.warning("kv sender: connection to %s ended: %s", self.address, exc)
        except asyncio.CancelledError:
            reason = "sender closed"
        finally:
            self.alive = False
            self.channel.close()
            self._sender._drop(self)
            for tx in list(self.transfers.values()):
                tx._fail(PeerLost(f"transfer {tx.transfer_id!r}: connection to {self.address} lost ({reason})"))


class KVSender:
    """Connects to decode workers (one cached connection per address) and starts transfers.

    Ships only to receivers that prove they hold the cluster secret (``auth``)."""

    def __init__(self, cache: KVCache | KVShards, config: KVTransferConfig, transport: Transport | None = None,
                 auth: ClusterAuth | None = None):
        self.shards = cache if isinstance(cache, KVShards) else KVShards.single(cache)
        self.config = config
        self.auth = auth or ClusterAuth.disabled()
        self._owns_transport = transport is None
        self.transport = transport or make_transport(config.transport, config)
        self._conns: dict[str, _ReceiverConnection] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def cache(self) -> KVCache:
        """This process's own cache (rank 0's, with tensor parallelism)."""
        return self.shards.caches[0]

    async def begin(self, transfer_id: str, address: str) -> OutgoingTransfer:
        """Start transfer ``transfer_id`` (the receiver's ``IncomingTransfer.transfer_id``) to the
        receiver at ``address`` (``"host:port"``); may raise ``HandshakeError`` (authentication
        failed either way, or layout mismatch: nothing sent) or ``PeerLost`` (cannot connect)."""
        conn = await self._connection(address)
        if transfer_id in conn.transfers:
            raise ValueError(f"transfer {transfer_id!r} is already in flight to {address}")
        tx = OutgoingTransfer(self, conn, transfer_id)
        conn.transfers[transfer_id] = tx
        return tx

    def describe(self, address: str) -> str | None:
        """What carries the bytes to ``address`` (e.g. the UCX lanes), if connected."""
        conn = self._conns.get(address)
        return conn.channel.description if conn is not None else None

    @property
    def num_in_flight(self) -> int:
        """Transfers started and not yet acknowledged or failed."""
        return sum(len(conn.transfers) for conn in self._conns.values())

    def get(self, transfer_id: str) -> OutgoingTransfer | None:
        for conn in self._conns.values():
            if transfer_id in conn.transfers:
                return conn.transfers[transfer_id]
        return None

    def abort(self, transfer_id: str, reason: str = "") -> bool:
        tx = self.get(transfer_id)
        if tx is None:
            return False
        tx.abort(reason)
        return True

    async def close(self) -> None:
        """Flush queued Aborts (bounded), then drop every connection."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.connect_timeout)
        for task in list(self._connecting.values()):
            task.cancel()
        for conn in list(self._conns.values()):
            conn.reader.cancel()
        await asyncio.gather(*[c.reader for c in self._conns.values()], *self._tasks, return_exceptions=True)
        if self._owns_transport:
            self.transport.close()

    async def _connection(self, address: str) -> _ReceiverConnection:
        conn = self._conns.get(address)
        if conn is not None and conn.alive:
            return conn
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = task
            task.add_done_callback(lambda _t: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: str) -> _ReceiverConnection:
        host, port = parse_address(address)
        try:
            channel = await self.transport.connect(host, port, self.config.connect_timeout)
        except ConnectionLost as exc:
            raise PeerLost(str(exc)) from None
        try:
            checksum, receiver_ranges = await client_handshake(channel, self.shards, self.config.checksum,
                                                               self.config.connect_timeout, self.auth)
            conn = _ReceiverConnection(self, address, channel, checksum, receiver_ranges)
        except BaseException:
            channel.close()
            raise
        log.info("kv sender connected to %s: %s (%d ranks here, %d there)", address, channel.description,
                 self.shards.num_ranks, len(receiver_ranges))
        self._conns[address] = conn
        return conn

    def _drop(self, conn: _ReceiverConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
