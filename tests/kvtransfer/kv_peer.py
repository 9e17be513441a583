"""A sender or receiver in its own process, for the multi-process tests.

    python tests/kvtransfer/kv_peer.py send --transport tcp --address H:P --transfer-id T --src 1,2,3 --dst 4,5,6 [--hang-after 1]
    python tests/kvtransfer/kv_peer.py recv --transport tcp --dst 4,5,6     (reports the transfer id it expects)

It reports progress as one JSON object per line on stdout ({"event": ...}) so the test can await
each step instead of sleeping. Caches are seeded (``kvt_support.random_cache``) so the test can
recompute the expected bytes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.getcwd()]

from common.engine.kv.kv_cache import KVCache  # noqa: E402
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, random_cache  # noqa: E402
from kvtransfer import KVReceiver, KVSender, KVTransferConfig, TransferError  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


async def send(args) -> None:
    sender = KVSender(random_cache(args.seed), KVTransferConfig(transport=args.transport), auth=AUTH)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["send", "recv"])
    parser.add_argument("--transport", required=True)
    parser.add_argument("--address")
    parser.add_argument("--transfer-id")
    parser.add_argument("--src")
    parser.add_argument("--dst", required=True)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=2)
    parser.add_argument("--hang-after", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    asyncio.run(send(args) if args.role == "send" else recv(args))


if __name__ == "__main__":
    main()
