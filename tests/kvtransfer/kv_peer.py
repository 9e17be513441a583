"""A sender or receiver in its own process, for the multi-process tests.

    python tests/kvtransfer/kv_peer.py send --transport tcp --address H:P --transfer-id T --src 1,2,3 --dst 4,5,6 [--hang-after 1]
    python tests/kvtransfer/kv_peer.py recv --transport tcp --dst 4,5,6     (reports the transfer id it expects)
    python tests/kvtransfer/kv_peer.py freeze --transport ucx               (a receiver that freezes its sender mid-payload)

It reports progress as one JSON object per line on stdout ({"event": ...}) so the test can await
each step instead of sleeping. Caches are seeded (``kvt_support.random_cache``) so the test can
recompute the expected bytes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.getcwd()]

from common.engine.kv.kv_cache import KVCache  # noqa: E402
from kvt_support import AUTH, BIG_BLOCKS, BIG_LAYOUT, LAYOUT, NUM_BLOCKS, random_cache  # noqa: E402
from kvtransfer import KVReceiver, KVSender, KVTransferConfig, TransferError  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


async def send(args) -> None:
    cache = random_cache(args.seed, BIG_LAYOUT, BIG_BLOCKS) if args.big else random_cache(args.seed)
    sender = KVSender(cache, KVTransferConfig(transport=args.transport), auth=AUTH)
    tx = await sender.begin(args.transfer_id, args.address)
    src, dst = ids(args.src), ids(args.dst)
    for i in range(0, len(src), args.chunk):
        await tx.send_blocks(src[i : i + args.chunk], dst[i : i + args.chunk])
        emit(event="chunk", index=i // args.chunk)
        if args.hang_after and i // args.chunk + 1 >= args.hang_after:
            await asyncio.Event().wait()  # the test kills us here, mid-transfer
    await tx.finish({"first_token": [123]})
    emit(event="acked")


async def recv(args) -> None:
    cfg = KVTransferConfig(transport=args.transport, transfer_timeout=args.timeout)
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg, auth=AUTH)
    address = await receiver.start()
    rx = receiver.expect("peer", ids(args.dst))
    emit(event="listening", address=address, transfer_id=rx.transfer_id)
    try:
        result = await rx.wait()
        emit(event="done", metadata=result.metadata)
    except TransferError as exc:
        emit(event="failed", error=f"{type(exc).__name__}: {exc}")


async def freeze(args) -> None:
    """Receive one large payload from a sender process started here, stop that sender (SIGSTOP) once
    the payload is landing, abort the transfer and report how it settles; then kill the sender and
    report the payload's end, and close.  Reports ``complete`` instead if the payload landed whole
    before it could be stopped (the test tries again)."""
    cache = KVCache(BIG_LAYOUT, BIG_BLOCKS)
    cfg = KVTransferConfig(transport=args.transport, abort_grace=1.0)
    receiver = KVReceiver(cache, cfg, auth=AUTH)
    address = await receiver.start()
    blocks = ",".join(map(str, range(BIG_BLOCKS)))
    rx = receiver.expect("frozen", list(range(BIG_BLOCKS)))
    sender = subprocess.Popen([sys.executable, __file__, "send", "--transport", args.transport, "--big",
                               "--address", address, "--transfer-id", rx.transfer_id, "--src", blocks,
                               "--dst", blocks, "--chunk", str(BIG_BLOCKS)], stdout=subprocess.DEVNULL)
    first, last = cache.buffer[0].view(-1), cache.buffer[BIG_BLOCKS - 1].view(-1)
    loop = asyncio.get_running_loop()
    try:
        while not (first[0] != 0 and last[-1] == 0):  # neither begun nor complete
            if last[-1] != 0 or rx.done() or sender.poll() is not None:
                emit(event="complete")
                return
            await asyncio.sleep(0.0005)
        os.kill(sender.pid, signal.SIGSTOP)
        emit(event="landing")
        began = loop.time()
        rx.abort("the test froze its sender")
        await asyncio.wait_for(rx.settled(), 60)
        still = rx.still_landing
        emit(event="settled", seconds=round(loop.time() - began, 3), still_landing=still is not None and not still.done())
        sender.kill()
        if still is not None:
            await asyncio.wait_for(asyncio.wait((still,)), 60)
            emit(event="landing_ended")
        await asyncio.wait_for(receiver.close(), 60)
        emit(event="closed")
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["send", "recv", "freeze"])
    parser.add_argument("--transport", required=True)
    parser.add_argument("--address")
    parser.add_argument("--transfer-id")
    parser.add_argument("--src")
    parser.add_argument("--dst")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=2)
    parser.add_argument("--hang-after", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--big", action="store_true", help="BIG_LAYOUT's blocks (freeze's sender)")
    args = parser.parse_args()
    asyncio.run({"send": send, "recv": recv, "freeze": freeze}[args.role](args))


if __name__ == "__main__":
    main()
