"""KV transfer throughput between two processes on one host, against references measured in step.

For a Llama-3-8B-shaped KV layout (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token,
16-token blocks) and 512- and 4096-token prompts, measure in one run:

* ``memcpy``: one ``memcpy`` of the same bytes inside one process, by one thread (what one
  thread moving the bytes can reach; a UCX transfer on one host is one such copy, made by the
  receiver's UCX progress thread through CMA);
* ``parallel_copy``: the same copy by torch over all its intra-op threads (closer to the memory
  bandwidth of the host: on a 2-core machine, about what two threads can move);
* ``socket_loopback``: a raw blocking-socket transfer between two processes over 127.0.0.1;
* ``ucx`` and ``tcp``: ``KVSender`` -> ``KVReceiver`` (authenticated, as deployed) in another
  process, from the first byte sent to the receiver's acknowledgement, straight from and into
  the KV cache tensors.

Shared hosts are noisy: a reference measured a minute apart from what it is compared with says
little. So every repetition measures the references and the transfer back to back -- a memcpy,
a parallel copy, then one UCX transfer; a raw-socket transfer, then one TCP transfer -- and the
ratios reported (``ucx_vs_memcpy``, ``ucx_vs_parallel_copy``, ``tcp_vs_socket_loopback``) are
the **median of the per-repetition ratios**; ``*_gbps`` are the
best repetition of each, and ``*_best_ratio`` the ratio of the bests. The first transfer of each
pair (connection set-up) is a warm-up, not counted.

On a busy machine wall-clock ratios mostly measure the scheduler: a transfer hands the work
from thread to thread across two processes, each hand-off waiting for a core, while a memcpy
runs in one go. ``ucx_cpu_efficiency_vs_memcpy`` is the load-independent figure: CPU seconds of
the memcpy over CPU seconds of the transfer (sender and receiver processes, every thread),
median over repetitions; on an idle machine the wall-clock ratio approaches it. The last line
of output is one JSON object.

    python benchmarks/kv_transfer.py [--quick] [--reps N] [--transports ucx,tcp] [--tokens 512,4096]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.engine.kv.kv_cache import KVCache, KVLayout  # noqa: E402

LAYOUT = KVLayout(model_id="llama-3-8b-shape", dtype="bfloat16", block_size=16, num_layers=32,
                  num_kv_heads=8, head_dim=128)
GB = 1e9
# One event loop for every transfer in this process: ucxx binds its context to the first loop.
_LOOP = asyncio.new_event_loop()


def blocks_for(tokens: int) -> int:
    return -(-tokens // LAYOUT.block_size)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


# -- references ---------------------------------------------------------------------------------

class ParallelCopy:
    """One in-process copy of ``nbytes`` per call by torch's intra-op threads (pages faulted in).
    ``cpu_seconds``: the CPU time of the last call (this process, all threads)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        self.cpu_seconds: list[float] = []

    def copy(self) -> None:
        self.dst.copy_(self.src)

    def __call__(self) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        self.copy()
        seconds = time.perf_counter() - start
        self.cpu_seconds.append(time.process_time() - cpu)
        return gbps(self.nbytes, seconds)

    def close(self) -> None:
        pass


class Memcpy(ParallelCopy):
    """One single-threaded ``memcpy`` of ``nbytes`` per call (numpy's copy is a plain memcpy)."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self._src, self._dst = self.src.numpy(), self.dst.numpy()

    def copy(self) -> None:
        np.copyto(self._dst, self._src)


def _socket_sink(port_queue, nbytes: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    while True:
        view = buf
        while view:
            n = conn.recv_into(view)
            if n == 0:
                conn.close()
                return
            view = view[n:]
        conn.sendall(b"k")


class SocketLoopback:
    """One raw blocking-socket transfer of ``nbytes`` to another process per call."""

    def __init__(self, nbytes: int):
        ctx = mp.get_context("spawn")
        port_queue = ctx.Queue()
        self.nbytes = nbytes
        self.sink = ctx.Process(target=_socket_sink, args=(port_queue, nbytes))
        self.sink.start()
        self.sock = socket.create_connection(("127.0.0.1", port_queue.get(timeout=60)))
        self.data = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
        self()  # warm-up: the sink's buffer is faulted in

    def __call__(self) -> float:
        start = time.perf_counter()
        self.sock.sendall(self.data)
        self.sock.recv(1)
        return gbps(self.nbytes, time.perf_counter() - start)

    def close(self) -> None:
        self.sock.close()
        self.sink.join(60)


# -- the KV transfer layer ------------------------------------------------------------------------

def _receiver_proc(transport: str, num_blocks: int, count: int, secret: str, queue, results) -> None:
    from common.cluster.auth import ClusterAuth
    from kvtransfer import KVReceiver, KVTransferConfig

    async def main() -> None:
        receiver = KVReceiver(KVCache(LAYOUT, num_blocks), KVTransferConfig(transport=transport, transfer_timeout=600),
                              auth=ClusterAuth(secret))
        address = await receiver.start()
        handles = [receiver.expect(f"r{i}", list(range(num_blocks))) for i in range(count)]
        queue.put((address, [h.transfer_id for h in handles]))
        cpu = [time.process_time()]  # every thread of this process: loop, UCX progress, notifier
        for handle in handles:
            await handle.wait()
            cpu.append(time.process_time())
        results.put([b - a for a, b in zip(cpu, cpu[1:])])
        await receiver.close()

    asyncio.run(main())


def kv_transfer(transport: str, tokens: int, reps: int, references) -> dict:
    """``reps`` rows (each reference, then the transfer) after one warm-up transfer; see the
    module docstring."""
    from common.cluster.auth import ClusterAuth, generate_secret
    from kvtransfer import KVSender, KVTransferConfig

    num_blocks = blocks_for(tokens)
    nbytes = num_blocks * LAYOUT.block_nbytes
    secret = generate_secret()
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_proc, args=(transport, num_blocks, reps + 1, secret, queue, results))
    proc.start()
    address, transfer_ids = queue.get(timeout=120)
    cache = KVCache(LAYOUT, num_blocks)
    cache.buffer.fill_(1.5)
    ids = list(range(num_blocks))

    async def main() -> dict:
        sender = KVSender(cache, KVTransferConfig(transport=transport, lease_timeout=600), auth=ClusterAuth(secret))
        rows, sender_cpu, described = [], [], None
        for i, transfer_id in enumerate(transfer_ids):
            refs = [reference() for reference in references] if i else None
            tx = await sender.begin(transfer_id, address)
            described = described or sender.describe(address)  # before the receiver may hang up
            start, cpu = time.perf_counter(), time.process_time()
            await tx.send_blocks(ids, ids)
            await tx.finish({"first_token": [1]})
            if i:
                rows.append((*refs, gbps(nbytes, time.perf_counter() - start)))
                sender_cpu.append(time.process_time() - cpu)
        await sender.close()
        receiver_cpu = results.get(timeout=120)[1:]
        return {"rows": rows, "described": described,
                "cpu_seconds": [s + r for s, r in zip(sender_cpu, receiver_cpu)]}

    try:
        return _LOOP.run_until_complete(main())
    finally:
        proc.join(120)


REFERENCES = {"ucx": {"memcpy": Memcpy, "parallel_copy": ParallelCopy}, "tcp": {"socket_loopback": SocketLoopback}}


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
    reps = args.reps or (5 if args.quick else 7)
    transports = args.transports.split(",")

    results = []
    ucx_lanes = None
    for tokens in prompts:
        nbytes = blocks_for(tokens) * LAYOUT.block_nbytes
        row = {"tokens": tokens, "bytes": nbytes}
        for transport in transports:
            names = list(REFERENCES[transport])
            print(f"# {tokens} tokens: {transport} vs {', '.join(names)} ...", file=sys.stderr, flush=True)
            references = [cls(nbytes) for cls in REFERENCES[transport].values()]
            try:
                measured = kv_transfer(transport, tokens, reps, references)
            finally:
                for reference in references:
                    reference.close()
            rows = measured["rows"]
            kvs = [r[-1] for r in rows]
            row[f"{transport}_gbps"] = max(kvs)
            for j, name in enumerate(names):
                refs = [r[j] for r in rows]
                row[f"{name}_gbps"] = max(refs)
                row[f"{transport}_vs_{name}"] = statistics.median(r[-1] / r[j] for r in rows)
                row[f"{transport}_vs_{name}_best_ratio"] = max(kvs) / max(refs)
            if transport == "ucx":
                ucx_lanes = measured["described"]
                # Load-independent: CPU seconds a memcpy needs / CPU seconds the transfer took
                # (sender + receiver processes), median over repetitions.
                memcpy_cpu = references[0].cpu_seconds
                row["ucx_cpu_efficiency_vs_memcpy"] = statistics.median(
                    m / t for m, t in zip(memcpy_cpu, measured["cpu_seconds"]))
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
