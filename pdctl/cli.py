"""pdctl: read and resize the pools of a running deployment, through the gateway's admin API.

    pdctl status                          table of the workers, by pool
    pdctl drain WORKER [--wait]           stop admitting, finish in-flight work, report idle
    pdctl set-role WORKER ROLE [--wait]   prefill | decode | both, live (also resumes a drained worker)
    pdctl rebalance [targets] [--apply]   propose (and apply) role moves that meet TTFT/TPOT targets
                                          (--gpu/--calibration: chosen by simulating the traffic)
    pdctl plan [traffic] [hardware]       simulate P:D splits on the real scheduler and router; recommend one
    pdctl calibrate [--model M]           measure engine steps here and fit the planner's cost model
    pdctl gen-secrets                     write compose/.env: project name and fresh secrets (mode 0600)
    pdctl rollout                         replace compose workers one at a time (drain, recreate, wait)
    pdctl scale --prefill N --decode M    resize compose workers; scale-down drains what it removes
    pdctl metrics-proxy                   Prometheus discovery and relay of worker /metrics

``--url`` (``PDSERVE_GATEWAY_URL``, default http://127.0.0.1:8000) says where the gateway is; the
admin token comes from ``PDSERVE_ADMIN_TOKEN`` or a file (``--admin-token-file``,
``PDSERVE_ADMIN_TOKEN_FILE``); ``--admin-token`` works too, with a warning (other users of the
machine can read a command line).  Exit status: 0 done, 1 the gateway or a worker refused or
failed, 2 bad command line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from common.cluster.flags import EnvFlags, FlagParser, secret_value
from common.cluster.registry import ROLES
from pdctl.deploy.cli import add_commands as add_deploy_commands, scale_command  # noqa: F401 (re-exported)
from pdctl.planner.cli import (
    add_calibrate_parser, add_plan_parser, add_rebalance_model_args, rebalance_by_simulation,
)
from pdctl.admin_client import AdminClient, AdminError
from pdctl.deploy.rollout import OperationError
from pdctl.rebalance import Move, Targets, WorkerReading, plan


# ---- status ----------------------------------------------------------------------------------


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def status_table(workers: list[dict]) -> str:
    """One row per worker, grouped by role, then a line per pool."""
    header = ("WORKER", "ROLE", "STATE", "WAIT", "RUN", "WAIT_TOK", "PREFILL_TOK/S", "KV", "TTFT_MS", "TPOT_MS",
              "SLOTS")
    rows = [header]
    order = {role: i for i, role in enumerate(ROLES)}
    for w in sorted(workers, key=lambda w: (order.get(w["role"], 9), w["worker_id"])):
        load, cap = w.get("load") or {}, w.get("capacity") or {}
        ttft, tpot = w.get("recent_ttft_s"), w.get("recent_tpot_s")
        rows.append((
            w["worker_id"], w["role"], w["state"], str(load.get("num_waiting", 0)), str(load.get("num_running", 0)),
            str(load.get("num_waiting_prefill_tokens", 0)), _fmt(load.get("prefill_tokens_per_s"), ".0f"),
            f"{load.get('kv_usage', 0.0):.0%}", _fmt(None if ttft is None else ttft * 1000, ".0f"),
            _fmt(None if tpot is None else tpot * 1000, ".1f"), str(cap.get("max_num_seqs", "-")),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    active = [w for w in workers if w["state"] == "active"]
    for pool, roles in (("prefill", ("prefill", "both")), ("decode", ("decode", "both"))):
        members = [w for w in active if w["role"] in roles]
        lines.append(f"{pool} pool: {len(members)} active worker(s)")
    parked = [w["worker_id"] for w in workers if w["state"] != "active"]
    if parked:
        lines.append(f"not routable: {', '.join(parked)}")
    return "\n".join(lines)


# ---- commands --------------------------------------------------------------------------------


def cmd_status(client: AdminClient, args) -> int:
    pools = client.pools()
    if args.json:
        print(json.dumps(pools, indent=2))
    else:
        print(f"model {pools.get('model')}")
        print(status_table(pools["workers"]))
    return 0


def cmd_drain(client: AdminClient, args) -> int:
    before = client.last_heartbeat(args.worker) if args.wait else 0.0
    answer = client.drain(args.worker)
    print(f"{args.worker}: {answer.get('state', 'draining')}")
    if args.wait:
        client.wait_for(args.worker, lambda w: w["state"] == "idle", "idle", args.timeout, before)
        print(f"{args.worker}: idle")
    return 0


def cmd_set_role(client: AdminClient, args) -> int:
    apply_move(client, Move(args.worker, "?", args.role), wait=args.wait, timeout=args.timeout)
    return 0


def apply_move(client: AdminClient, move: Move, *, wait: bool, timeout: float) -> None:
    """Set the role; with ``wait``, until the pools show it active in its new role with a fresh
    heartbeat (its in-flight work of the old role finishes in the background)."""
    before = client.last_heartbeat(move.worker_id) if wait else 0.0
    answer = client.set_role(move.worker_id, move.to_role)
    print(f"{move.worker_id}: role {answer.get('role', move.to_role)}, state {answer.get('state', '?')}")
    if wait:
        client.wait_for(move.worker_id, lambda w: w["role"] == move.to_role and w["state"] == "active",
                        f"{move.to_role}/active", timeout, before)
        print(f"{move.worker_id}: settled as {move.to_role}")


def targets_from_args(args) -> Targets:
    return Targets(ttft_s=args.ttft_target, tpot_s=args.tpot_target, prefill_rate=args.prefill_rate,
                   utilization=args.utilization, kv_target=args.kv_target)


def cmd_rebalance(client: AdminClient, args) -> int:
    targets = targets_from_args(args)
    readings = [WorkerReading.from_info(w) for w in client.workers()]
    if args.gpu or args.calibration:  # choose the split by simulating the traffic (pdctl/planner)
        result = rebalance_by_simulation(readings, args)
    else:
        result = plan(readings, targets)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        for line in result.reasons:
            print(line)
        print(f"prefill pool {result.prefill_now} -> needs {result.prefill_needed}; "
              f"decode pool {result.decode_now} -> needs {result.decode_needed}")
        if not result.moves:
            print("no moves")
        for move in result.moves:
            print(f"move {move.worker_id}: {move.from_role} -> {move.to_role}")
    if args.apply:
        for move in result.moves:  # one at a time, each settled before the next
            apply_move(client, move, wait=True, timeout=args.timeout)
    elif result.moves and not args.json:
        print("dry run: add --apply to make these moves")
    return 0


# ---- command line ----------------------------------------------------------------------------


def seconds(text: str) -> float:
    """A ``--timeout``: a finite number of seconds above 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a number of seconds above 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = FlagParser(prog="pdctl", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--url", default=env("PDSERVE_GATEWAY_URL", "http://127.0.0.1:8000"), help="the gateway")
    EnvFlags(p).add_secret("--admin-token", "the admin token", help="X-Admin-Token")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("status", help="table of the pools")
    s.add_argument("--json", action="store_true", help="the raw /admin/pools answer")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("drain", help="stop admitting, finish in-flight work, then report idle")
    s.add_argument("worker")
    s.add_argument("--wait", action="store_true", help="until the worker reports idle")
    s.add_argument("--timeout", type=seconds, default=600.0)
    s.set_defaults(func=cmd_drain)

    s = sub.add_parser("set-role", help="change a worker's role live")
    s.add_argument("worker")
    s.add_argument("role", choices=ROLES)
    s.add_argument("--wait", action="store_true", help="until the pools show the new role")
    s.add_argument("--timeout", type=seconds, default=60.0)
    s.set_defaults(func=cmd_set_role)

    s = sub.add_parser("rebalance", help="compute the prefill:decode split the load needs; --apply to move",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--ttft-target", type=float, default=2.0, help="seconds to first token")
    s.add_argument("--tpot-target", type=float, default=0.2, help="seconds per output token")
    s.add_argument("--prefill-rate", type=float, default=None,
                   help="one worker's prefill throughput in tokens/s (default: estimated from the readings)")
    s.add_argument("--utilization", type=float, default=0.8, help="plan each worker to this fraction of capacity")
    s.add_argument("--kv-target", type=float, default=0.8, help="plan decode workers to this KV usage at most")
    s.add_argument("--apply", action="store_true", help="make the moves, one at a time (default: dry run)")
    s.add_argument("--timeout", type=seconds, default=60.0, help="seconds each move may take to settle")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_rebalance)
    add_rebalance_model_args(s)  # --gpu/--calibration: choose the split by simulation

    add_planner_parsers(sub)
    add_deploy_commands(sub)  # gen-secrets, rollout, scale, metrics-proxy (pdctl/deploy)
    return p


def add_planner_parsers(sub) -> None:
    """``plan`` and ``calibrate`` live in pdctl/planner (they need no gateway to talk to)."""
    add_plan_parser(sub)
    add_calibrate_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        client = AdminClient(args.url, secret_value(args, "admin_token", "the admin token"))
        return args.func(client, args)
    except (AdminError, OperationError) as exc:  # a deploy step or backend command failed: said, no traceback
        print(f"pdctl: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"pdctl: error: {exc}", file=sys.stderr)
        return 2

