"""A prefill worker scripted in the test process, for fault tests of a real decode worker: registered
with the stack's cluster secret, answering ``/prefill`` as each test says, shipping canary KV
(every value ``CANARY``) with the real ``KVSender`` through a TCP link that can hold the bytes
mid-payload (``ThrottledLink``); and a client of the decode worker's ``/generate`` and ``/abort``
(``WorkerClient``, ``Stream``)."""
from __future__ import annotations

import asyncio
import uuid

import aiohttp
from aiohttp import web

from common.cluster.auth import ClusterAuth
from common.cluster.messages import (
    AbortRequest, GenerateRequest, PrefillRequest, TokenFrame, decode, encode, read_frame,
)
from common.cluster.redis_util import connect
from common.cluster.registry import Capacity, KVAddress, WorkerInfo, WorkerRegistry
from common.engine.engine import Engine
from common.engine.kv.kv_cache import KVCache
from common.engine.sampling_params import SamplingParams
from kvtransfer.config import KVTransferConfig
from kvtransfer.sender import KVSender
from tests.support.cluster import LocalStack
from tests.support.waiting import until

BLOCK_SIZE = 4
NUM_BLOCKS = 16          # a prompt of 10 blocks plus its output needs the whole pool
MAX_TOKENS = 24
CANARY = 100.0
WAIT = 120.0             # generous bound for anything the test waits on


class ThrottledLink:
    """A TCP relay in front of the worker's KV port that can hold the sender's bytes mid-frame.

    ``hold_after(n)``: forward at most ``n`` more bytes towards the receiver, then hold the rest
    (``held`` is set) until ``release()``.  Replies (Welcome, Ack, Abort) always pass."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.held = asyncio.Event()
        self._quota: int | None = None
        self._released = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def hold_after(self, nbytes: int) -> None:
        self._quota = nbytes
        self._released.clear()

    def release(self) -> None:
        self._quota = None
        self._released.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        tasks = [asyncio.ensure_future(self._pump(reader, up_writer, throttled=True)),
                 asyncio.ensure_future(self._pump(up_reader, writer, throttled=False))]
        self._tasks.update(tasks)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        writer.close()
        up_writer.close()

    async def _pump(self, reader, writer, throttled: bool) -> None:
        while data := await reader.read(1 << 16):
            while data:
                if not throttled or self._quota is None:
                    chunk = data
                elif self._quota > 0:
                    chunk = data[: self._quota]
                    self._quota -= len(chunk)
                else:
                    await writer.drain()
                    self.held.set()
                    await self._released.wait()
                    continue
                writer.write(chunk)
                data = data[len(chunk):]
            await writer.drain()

    async def close(self) -> None:
        self.release()
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()


class ScriptedPeer:
    """A stand-in prefill worker: ``/prefill`` runs ``self.script(request)``; ``/abort`` is noted."""

    def __init__(self, engine: Engine, stack: LocalStack):
        self.stack = stack
        self.worker_id = f"scripted-{uuid.uuid4().hex[:8]}"
        self.redis = connect(stack.redis_url)
        self.registry = WorkerRegistry(self.redis, key_prefix=stack.key_prefix, ttl_s=600,
                                       auth=ClusterAuth(stack.cluster_secret))
        layout = engine.kv_cache.layout
        self.cache = KVCache(layout, NUM_BLOCKS)
        self.cache.buffer.fill_(CANARY)
        self.sender = KVSender(self.cache, KVTransferConfig(transport="tcp"), auth=ClusterAuth(stack.cluster_secret))
        self.script = None
        self.aborted: set[str] = set()
        self.stopping = asyncio.Event()
        self.links: list[ThrottledLink] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "ScriptedPeer":
        app = web.Application()
        app.router.add_post("/prefill", self._prefill)
        app.router.add_post("/abort", self._abort)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        await self.registry.register(WorkerInfo(
            worker_id=self.worker_id, role="prefill", model=self.stack.model_name, http_address=self.url,
            kv_address=KVAddress("tcp", "127.0.0.1", 1), state="active",
            capacity=Capacity(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8)))
        return self

    async def kv_address(self, request: PrefillRequest) -> KVAddress:
        """Where the calling decode worker receives KV: its registry entry, as a real prefill worker does."""
        entry = await self.registry.get(self.stack.model_name, request.decode_worker_id)
        return entry.kv_address

    async def link(self, request: PrefillRequest) -> tuple[ThrottledLink, str]:
        kv = await self.kv_address(request)
        link = ThrottledLink((kv.host, kv.port))
        self.links.append(link)
        return link, await link.start()

    async def _prefill(self, request: web.Request) -> web.Response:
        body = decode(await request.read(), PrefillRequest)
        result, status = await self.script(body)
        return web.Response(body=encode(result), status=status)

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborted.add(decode(await request.read(), AbortRequest).request_id)
        return web.json_response({"aborted": True})

    async def hang(self) -> None:
        """What a hung peer does: nothing, until the test ends."""
        await self.stopping.wait()

    async def close(self) -> None:
        self.stopping.set()
        for link in self.links:
            await link.close()
        await self.sender.close()
        await self._runner.cleanup()
        await self.registry.deregister(self.stack.model_name, self.worker_id)
        await self.redis.aclose()


def last_run(dst_block_ids: list[int]) -> tuple[list[int], list[int]]:
    """The last run of consecutive destination ids, with as many consecutive canary sources.

    An abandoned reservation is freed tail first, so its last blocks are the first to be handed
    out again: a late write there is what would corrupt the next user."""
    start = len(dst_block_ids) - 1
    while start > 0 and dst_block_ids[start - 1] == dst_block_ids[start] - 1:
        start -= 1
    dst = dst_block_ids[start:]
    return list(range(len(dst))), dst


async def ship_held(peer: ScriptedPeer, request: PrefillRequest) -> ThrottledLink:
    """Start shipping canary KV for the last run of the reservation and hold it mid-payload
    (the receiver is writing into the blocks when the bytes stop)."""
    link, address = await peer.link(request)
    transfer = await peer.sender.begin(request.transfer_id, address)
    link.hold_after(512)  # past the frame header, well inside the first block's payload
    src, dst = last_run(request.dst_block_ids)
    asyncio.ensure_future(transfer.send_blocks(src, dst))
    await asyncio.wait_for(link.held.wait(), WAIT)
    return link


class Stream:
    """One /generate call on the decode worker, read frame by frame in the background."""

    def __init__(self, client: "WorkerClient", prompt: list[int], prefill_worker_id: str | None,
                 max_tokens: int = MAX_TOKENS):
        self.frames: list[TokenFrame] = []
        self.first = asyncio.Event()
        body = GenerateRequest(request_id=f"t-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                               sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               prefill_worker_id=prefill_worker_id)
        self.task = asyncio.ensure_future(self._read(client, encode(body)))

    async def _read(self, client: "WorkerClient", data: bytes) -> list[TokenFrame]:
        async with client.post("/generate", data) as resp:
            while (frame := await read_frame(resp.content, TokenFrame)) is not None:
                self.frames.append(frame)
                self.first.set()
                if frame.finished or frame.error:
                    break
        return self.frames

    async def tokens(self) -> list[int]:
        frames = await asyncio.wait_for(self.task, WAIT)
        errors = [f.error for f in frames if f.error]
        assert not errors, errors
        return [t for f in frames for t in f.token_ids]


class WorkerClient:
    """Calls the decode worker's internal API the way its peers do (signed with the cluster secret)."""

    def __init__(self, stack: LocalStack, name: str = "d0"):
        self.audience = stack.worker_audience(name)  # its id and run: what every call is signed for
        self.url = stack.worker_url(name)
        self.auth = ClusterAuth(stack.cluster_secret)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "WorkerClient":
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    def post(self, path: str, data: bytes):
        return self.session.post(self.url + path, data=data,
                                 headers=self.auth.sign_request("POST", path, data, audience=self.audience))

    def generate(self, prompt: list[int], prefill_worker_id: str | None) -> Stream:
        return Stream(self, prompt, prefill_worker_id)

    async def stats(self) -> dict:
        async with self.session.get(self.url + "/stats",
                                    headers=self.auth.sign_request("GET", "/stats", audience=self.audience)) as resp:
            return await resp.json()

    async def idle(self) -> dict:
        async def check():
            s = await self.stats()
            return s if s["inflight"] == 0 and s["num_free_blocks"] == s["num_blocks"] else None
        return await until(check, "the decode worker to go idle with every block free")
