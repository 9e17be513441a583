"""Chaos benchmark: the chaos scenario of tests/serving/test_chaos.py, run for ``--minutes``.

    python benchmarks/chaos.py --minutes 3 [--transport tcp|ucx] [--requests 300] [--concurrency 12]

A real stack (gateway, 2 prefill + 2 decode workers, a private redis-server, a tiny random Llama,
small KV pools) serves rounds of ``--requests`` requests from the official ``openai`` client until
``--minutes`` have passed; every round repeats the faults (hostile input and garbage on the KV
ports, a prefill worker and a decode worker SIGKILLed and restarted by the launcher's supervisor,
Redis killed and restarted) while clients leave at random points.  Scenario and checks:
``benchmarks/chaos_scenario.py``.

The last stdout line is one JSON object: ``requests``, ``completed``, ``explicit_errors``,
``disconnected``, ``hangs``, ``broken``, ``parity_checked``, ``parity_mismatches``, ``leaked_blocks``,
``workers_healthy_at_end`` and more; the whole result (events, examples of errors) goes to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_util import emit  # noqa: E402
from benchmarks.chaos_scenario import ChaosConfig, run_chaos, summary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="keep running rounds until this much time passed")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ucx"))
    parser.add_argument("--requests", type=int, default=300, help="requests per round (faults repeat each round)")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "chaos.json")
    args = parser.parse_args()
    config = ChaosConfig(transport=args.transport, requests=args.requests, minutes=args.minutes,
                         concurrency=args.concurrency, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as workdir:
        result = run_chaos(config, Path(workdir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    for line in result["events"]:
        print(line)
    print(f"full result: {args.out}")
    emit(summary(result))


if __name__ == "__main__":
    main()
