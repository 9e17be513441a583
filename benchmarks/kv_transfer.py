"""KV transfer throughput between two processes on one host, against in-run references.

For a Llama-3-8B-shaped KV layout (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token,
16-token blocks) and 512- and 4096-token prompts, measure in one run:

* ``memcpy``: copying the same bytes inside one process (the physical limit on one host);
* ``socket_loopback``: a raw blocking-socket transfer between two processes over 127.0.0.1;
* ``ucx`` and ``tcp``: ``KVSender`` -> ``KVReceiver`` in another process, from the first byte
  sent to the receiver's acknowledgement, straight from and into the KV cache tensors.

Each figure is the best of ``--reps`` repetitions (shared hosts are noisy). The last line of
output is one JSON object. ``--quick`` runs only the 512-token prompt with fewer repetitions.

    python benchmarks/kv_transfer.py [--quick] [--reps N] [--transports ucx,tcp]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.engine.kv_cache import KVCache, KVLayout  # noqa: E402

LAYOUT = KVLayout(model_id="llama-3-8b-shape", dtype="bfloat16", block_size=16, num_layers=32,
                  num_kv_heads=8, head_dim=128)
GB = 1e9
# One event loop for every transfer in this process: ucxx binds its context to the first loop.
_LOOP = asyncio.new_event_loop()


def blocks_for(tokens: int) -> int:
    return -(-tokens // LAYOUT.block_size)


# -- references ---------------------------------------------------------------------------------

def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / (time.perf_counter() - start) / GB)
    return best


def _socket_sink(port_queue, nbytes: int, reps: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    for _ in range(reps):
        view = buf
        while view:
            n = conn.recv_into(view)
            if n == 0:
                return
            view = view[n:]
        conn.sendall(b"k")
    conn.close()


def socket_loopback_gbps(nbytes: int, reps: int) -> float:
    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    sink = ctx.Process(target=_socket_sink, args=(port_queue, nbytes, reps))
    sink.start()
    sock = socket.create_connection(("127.0.0.1", port_queue.get(timeout=60)))
    data = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        best = max(best, nbytes / (time.perf_counter() - start) / GB)
    sock.close()
    sink.join(60)
    return best


# -- the KV transfer layer ------------------------------------------------------------------------

def _receiver_proc(transport: str, num_blocks: int, reps: int, queue) -> None:
    from kvtransfer import KVReceiver, KVTransferConfig

    async def main() -> None:
        receiver = KVReceiver(KVCache(LAYOUT, num_blocks), KVTransferConfig(transport=transport, transfer_timeout=600))
        address = await receiver.start()
        handles = [receiver.expect(f"r{i}", list(range(num_blocks))) for i in range(reps)]
        queue.put(address)
        for handle in handles:
            await handle.wait()
        await receiver.close()

    asyncio.run(main())


def kv_transfer_gbps(transport: str, tokens: int, reps: int) -> tuple[float, str | None]:
    from kvtransfer import KVSender, KVTransferConfig

    num_blocks = blocks_for(tokens)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver_proc, args=(transport, num_blocks, reps, queue))
    proc.start()
    address = queue.get(timeout=120)
    cache = KVCache(LAYOUT, num_blocks)
    cache.buffer.fill_(1.5)
    ids = list(range(num_blocks))

    async def main() -> tuple[float, str | None]:
        sender = KVSender(cache, KVTransferConfig(transport=transport, lease_timeout=600))
        best = 0.0
        for i in range(reps):
            tx = await sender.begin(f"r{i}", address)
            start = time.perf_counter()
            await tx.send_blocks(ids, ids)
            await tx.finish({"first_token": [1]})
            best = max(best, num_blocks * LAYOUT.block_nbytes / (time.perf_counter() - start) / GB)
        described = sender.describe(address)
        await sender.close()
        return best, described

    try:
        return _LOOP.run_until_complete(main())
    finally:
        proc.join(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512-token prompt only, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--transports", default="ucx,tcp")
    parser.add_argument("--tokens", default=None, help="comma-separated prompt lengths (default 512,4096)")
    args = parser.parse_args()
    prompts = [512] if args.quick else [512, 4096]
    if args.tokens:
        prompts = [int(t) for t in args.tokens.split(",")]
    reps = args.reps or (3 if args.quick else 5)
    transports = args.transports.split(",")

    results = []
    ucx_lanes = None
    for tokens in prompts:
        nbytes = blocks_for(tokens) * LAYOUT.block_nbytes
        row = {"tokens": tokens, "bytes": nbytes,
               "memcpy_gbps": memcpy_gbps(nbytes, reps),
               "socket_loopback_gbps": socket_loopback_gbps(nbytes, reps)}
        for transport in transports:
            print(f"# {tokens} tokens: {transport} ...", file=sys.stderr, flush=True)
            gbps, described = kv_transfer_gbps(transport, tokens, reps)
            row[f"{transport}_gbps"] = gbps
            if transport == "ucx":
                ucx_lanes = described
        if "ucx_gbps" in row:
            row["ucx_vs_memcpy"] = row["ucx_gbps"] / row["memcpy_gbps"]
        if "tcp_gbps" in row:
            row["tcp_vs_socket_loopback"] = row["tcp_gbps"] / row["socket_loopback_gbps"]
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(json.dumps(row), flush=True)
        results.append(row)

    summary = dict(results[-1])  # headline figures: the largest prompt
    summary["per_prompt"] = results
    summary["reps"] = reps
    summary["cpu_count"] = os.cpu_count()
    if "ucx" in transports:
        from kvtransfer.transport_ucx import ucx_settings

        summary["ucx_transports"] = ucx_lanes
        summary["ucx_settings"] = ucx_settings()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
