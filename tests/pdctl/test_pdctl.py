"""pdctl: the rebalance model on synthetic load readings, `scale`, and the CLI against a running
stack (status, set-role, rebalance --apply, and bad admin input changing nothing)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from launcher.local_stack import ROOT, LocalStack
from pdctl import cli as pdctl
from pdctl.rebalance import Move, Targets, WorkerReading, choose_split, plan
from tests.support.cluster import ADMIN_TOKEN, http_json, running_cluster

pytestmark = pytest.mark.slow(seconds=20)  # a long file: scheduled by its length (tests/conftest.py)


def w(worker_id: str, role: str, **load) -> WorkerReading:
    return WorkerReading(worker_id=worker_id, role=role, **load)


# ---- the rebalance model (pure) --------------------------------------------------------------


def test_balanced_load_proposes_nothing():
    readings = [w("p0", "prefill", prefill_tokens_per_s=400, waiting_prefill_tokens=100),
                w("p1", "prefill", prefill_tokens_per_s=300),
                w("d0", "decode", num_running=20, kv_usage=0.3), w("d1", "decode", num_running=18, kv_usage=0.3)]
    result = plan(readings, Targets(prefill_rate=1000))
    assert (result.prefill_needed, result.decode_needed) == (1, 1)
    assert result.moves == []  # both pools already meet their targets: no flapping


def test_prefill_backlog_moves_the_least_loaded_decode_worker():
    # 2 prefill workers saturated at 1000 tok/s each with 6000 tokens queued, TTFT target 2 s:
    # demand = 2000 + 6000/2 = 5000 tok/s at 80% of 1000 -> 7 workers; decode needs 1 (4 streams).
    readings = [w("p0", "prefill", prefill_tokens_per_s=1000, waiting_prefill_tokens=3000),
                w("p1", "prefill", prefill_tokens_per_s=1000, waiting_prefill_tokens=3000),
                w("d0", "decode", num_running=3, kv_usage=0.1), w("d1", "decode", num_running=1, kv_usage=0.05),
                w("d2", "decode", num_running=0, kv_usage=0.0)]
    result = plan(readings, Targets(ttft_s=2.0))  # capacity estimated from the saturated workers
    assert result.prefill_needed == 7 and result.decode_needed == 1
    # 5 movable workers: 4 prefill + 1 decode is the smallest shortfall; the emptiest decoders go.
    assert result.moves == [Move("d2", "decode", "prefill"), Move("d1", "decode", "prefill")]


def test_decode_pressure_from_slots_and_kv():
    # 150 streams on 2 decoders of 64 slots at 80% -> 3; KV 0.95 + 0.9 at 0.8 -> 3.
    readings = [w("p0", "prefill", prefill_tokens_per_s=100), w("p1", "prefill", prefill_tokens_per_s=50),
                w("p2", "prefill"),
                w("d0", "decode", num_running=75, kv_usage=0.95), w("d1", "decode", num_running=75, kv_usage=0.9)]
    result = plan(readings, Targets(prefill_rate=1000))
    assert result.decode_needed == 3 and result.prefill_needed == 1
    assert result.moves == [Move("p2", "prefill", "decode")]  # the idle prefill worker moves
    # KV alone: few streams, but long ones filling memory.
    readings[3:] = [w("d0", "decode", num_running=4, kv_usage=0.99), w("d1", "decode", num_running=4, kv_usage=0.9)]
    assert plan(readings, Targets(prefill_rate=1000)).decode_needed == 3


def test_tpot_over_target_asks_for_one_more_decode_worker():
    readings = [w("p0", "prefill"), w("p1", "prefill"),
                w("d0", "decode", num_running=2, tpot_s=0.5), w("d1", "decode", num_running=2, tpot_s=0.3)]
    result = plan(readings, Targets(tpot_s=0.2, prefill_rate=1000))
    assert result.decode_needed == 3
    assert result.moves == [Move("p0", "prefill", "decode")]
    assert any("TPOT 0.400s over" in reason for reason in result.reasons)
    assert plan(readings, Targets(tpot_s=1.0, prefill_rate=1000)).moves == []


def test_ttft_over_target_asks_for_one_more_prefill_worker():
    readings = [w("p0", "prefill", prefill_tokens_per_s=100),
                w("d0", "decode", num_running=1, ttft_s=5.0), w("d1", "decode", ttft_s=4.0)]
    result = plan(readings, Targets(ttft_s=1.0, prefill_rate=10_000))
    assert result.prefill_needed == 2
    assert result.moves == [Move("d1", "decode", "prefill")]


def test_pools_never_drop_below_one_and_both_workers_count_for_both():
    # Everything wants decode, but the last prefill worker stays.
    readings = [w("p0", "prefill"), w("d0", "decode", num_running=64, kv_usage=1.0)]
    result = plan(readings, Targets(prefill_rate=1000))
    assert result.decode_needed == 2 and result.moves == []
    # A `both` worker covers the prefill pool, so the dedicated prefill worker can go.
    readings.append(w("b0", "both", num_running=64, kv_usage=1.0))
    result = plan(readings, Targets(prefill_rate=1000))
    assert (result.prefill_now, result.decode_now) == (2, 2)
    assert (result.prefill_needed, result.decode_needed) == (1, 3)
    assert result.moves == [Move("p0", "prefill", "decode")]


def test_only_active_workers_are_counted_or_moved():
    readings = [w("p0", "prefill", prefill_tokens_per_s=1000, waiting_prefill_tokens=8000),
                w("d0", "decode"), w("d1", "decode", state="draining"), w("d2", "decode", state="idle")]
    result = plan(readings, Targets(prefill_rate=1000))
    assert result.decode_now == 1 and result.moves == []  # d0 is the last active decoder


def test_split_prefers_the_smallest_relative_shortfall_then_the_fewest_moves():
    assert choose_split(movable=8, both=0, prefill_now=4, need_p=2, need_d=3) == 4  # both met: stay
    assert choose_split(movable=8, both=0, prefill_now=4, need_p=6, need_d=2) == 6
    assert choose_split(movable=4, both=0, prefill_now=1, need_p=8, need_d=8) in (2, 1)
    assert choose_split(movable=2, both=0, prefill_now=1, need_p=9, need_d=1) == 1  # decode keeps 1


def test_readings_from_registry_json():
    info = {"worker_id": "d0", "role": "decode", "state": "active", "capacity": {"max_num_seqs": 8},
            "load": {"num_waiting": 1, "num_running": 5, "kv_usage": 0.5, "num_waiting_prefill_tokens": 7,
                     "prefill_tokens_per_s": 12.5},
            "recent_ttft_s": 0.2, "recent_tpot_s": None}
    assert WorkerReading.from_info(info) == WorkerReading(
        "d0", "decode", "active", 1, 5, 0.5, 7, 12.5, 8, 0.2, None)


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="utilization"):
        Targets(utilization=1.5)
    with pytest.raises(ValueError, match="ttft_s"):
        Targets(ttft_s=0)
    assert pdctl.main(["rebalance", "--kv-target", "0"]) == 2


@pytest.mark.parametrize("command", [["drain", "w", "--wait"], ["set-role", "w", "decode", "--wait"], ["rebalance"]])
@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf"])
def test_a_timeout_is_a_number_of_seconds_above_zero(command, timeout, capsys):
    with pytest.raises(SystemExit) as exited:
        pdctl.build_parser().parse_args([*command, "--timeout", timeout])
    assert exited.value.code == 2 and "--timeout: must be a number of seconds above 0" in capsys.readouterr().err
    assert pdctl.build_parser().parse_args([*command, "--timeout", "2.5"]).timeout == 2.5


# ---- scale -------------------------------------------------------------------------------------


def test_scale_command_and_refusals(capsys):
    """`scale` itself (drain-aware, via a backend) is tested in tests/deploy/test_pdctl_deploy.py."""
    assert pdctl.main(["scale", "--prefill", "5", "--decode", "5", "--gpus", "8"]) == 2
    assert "= 10 GPUs, more than the 8 this host has" in capsys.readouterr().err
    assert pdctl.main(["scale", "--prefill", "0", "--decode", "0"]) == 2
    cmd = pdctl.scale_command(1, 2, "compose/docker-compose.cpu.yml", "docker-compose", ".env", "pd")
    assert cmd == ["docker-compose", "-p", "pd", "--env-file", ".env", "-f", "compose/docker-compose.cpu.yml",
                   "up", "-d", "--no-recreate", "--scale", "prefill=1", "--scale", "decode=2"]


# ---- against a running stack -------------------------------------------------------------------

TOKEN = ADMIN_TOKEN  # what tests/support/cluster.py gives the gateway


@pytest.fixture(scope="module")
def cluster(served_checkpoint, tmp_path_factory, redis_url):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("pdctl"), redis_url, prefill=1, decode=2,
                         worker_args=["--num-blocks", "256"]) as c:
        yield c


def run_pdctl(cluster: LocalStack, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    """The CLI as an operator runs it (a separate process)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "pdctl", "--url", cluster.gateway_url]
    if token is not None:
        base += ["--admin-token", token]
    return subprocess.run([*base, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def pool_entries(cluster: LocalStack) -> list[dict]:
    return http_json(f"{cluster.gateway_url}/admin/pools", headers={"X-Admin-Token": TOKEN})["workers"]


def roles(cluster: LocalStack) -> dict[str, tuple[str, str]]:
    """(role, state) of every worker.  Waits until all three are registered: on a loaded machine a
    heartbeat can run late enough for an entry to lapse for a moment."""
    deadline = time.monotonic() + 30
    while True:
        entries = {w["worker_id"]: (w["role"], w["state"]) for w in pool_entries(cluster)}
        if len(entries) == 3 or time.monotonic() > deadline:
            return entries
        time.sleep(0.1)


def test_status_table(cluster):
    result = run_pdctl(cluster, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:3] == ["WORKER", "ROLE", "STATE"]
    assert {line.split()[0] for line in lines[2:5]} == {"p0", "d0", "d1"}
    assert "prefill pool: 1 active worker(s)" in result.stdout
    assert "decode pool: 2 active worker(s)" in result.stdout
    raw = json.loads(run_pdctl(cluster, "status", "--json").stdout)
    assert {w["worker_id"] for w in raw["workers"]} == {"p0", "d0", "d1"}


def test_calibrate_live_fits_the_steps_the_workers_ran(cluster, tmp_path):
    import openai

    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="x", max_retries=0)
    for i in range(6):
        client.completions.create(model=cluster.model_name, prompt=f"calibrate {i} " * (10 + 20 * i),
                                  max_tokens=12, temperature=0)
    url, admin = cluster.gateway_url, {"X-Admin-Token": TOKEN}
    # One worker's log through the gateway, a page at a time, with the engine's settings.
    page = http_json(f"{url}/admin/workers/p0/steps?limit=2", headers=admin)
    assert page["columns"][:2] == ["ended_at", "seconds"] and len(page["steps"]) == 2 and page["more"] is True
    assert page["engine"]["block_size"] == 16 and page["recorded"] >= 6
    after = http_json(f"{url}/admin/workers/p0/steps?since={page['steps'][-1][0]!r}", headers=admin)
    assert after["steps"] and after["steps"][0][0] > page["steps"][-1][0]
    for query in ("limit=0", "limit=99999", "since=nan", "since=inf", "since=soon"):
        with pytest.raises(Exception) as err:
            http_json(f"{url}/admin/workers/p0/steps?{query}", headers=admin)
        assert err.value.code == 400, query
        assert "expected ?since=<unix time>&limit=<1-4096>" in json.loads(err.value.read())["error"]["message"]
    with pytest.raises(Exception) as err:
        http_json(f"{url}/admin/workers/p0/steps")  # no admin token
    assert err.value.code == 401
    with pytest.raises(Exception) as err:  # the worker itself: the admin token alone is not enough
        http_json(f"{cluster.worker_url('p0')}/admin/steps", headers=admin)
    assert err.value.code == 401

    out = tmp_path / "live.json"
    result = run_pdctl(cluster, "calibrate", "--live", "--window", "600", "--min-steps", "20", "--out", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    fit = doc["cost_model"]["fit"]
    assert fit["source"] == "live" and set(fit["workers"]) == {"p0", "d0", "d1"}
    assert fit["prefill_steps"] > 0 and fit["decode_steps"] >= 12 and fit["max_tokens"] > 100
    assert doc["engine"]["max_model_len"] > 0 and json.loads(result.stdout.splitlines()[-1])["kind"] == "linear"
    # The file plans like any calibration.
    plan = subprocess.run([sys.executable, "-m", "pdctl", "plan", "--calibration", str(out), "--num-blocks", "256",
                           "--rate", "2", "--duration", "10", "--prompt-len", "uniform:32:256", "--output-len", "fixed:16",
                           "--split", "1:1", "--slo-ttft", "2", "--slo-tpot", "0.2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout.splitlines()[-1])["candidates"][0]["deployment"] == "1P+1D"

    refused = run_pdctl(cluster, "calibrate", "--live", "--worker", "nope", "--out", str(tmp_path / "x.json"))
    assert refused.returncode == 2 and "no such worker" in refused.stderr
    assert not (tmp_path / "x.json").exists()


def test_bad_admin_input_is_refused_and_changes_nothing(cluster):
    before = roles(cluster)
    url = cluster.gateway_url

    result = run_pdctl(cluster, "set-role", "nope", "prefill")
    assert result.returncode == 1 and "HTTP 404" in result.stderr and "unknown worker 'nope'" in result.stderr
    result = run_pdctl(cluster, "drain", "nope")
    assert result.returncode == 1 and "HTTP 404" in result.stderr

    result = run_pdctl(cluster, "set-role", "d0", "sideways")  # refused by pdctl's own parser
    assert result.returncode == 2 and "argument role: invalid choice: (value not shown) (choose from" in result.stderr
    for body in (b'{"role": "sideways"}', b'{"rol": "decode"}', b"not json", b'["prefill"]'):
        with pytest.raises(Exception) as err:  # and by the gateway itself
            http_json(f"{url}/admin/workers/d0/role", "POST", body, {"X-Admin-Token": TOKEN})
        assert err.value.code == 400
        message = json.loads(err.value.read())["error"]["message"]
        assert "role" in message

    result = run_pdctl(cluster, "set-role", "d0", "prefill", token=None)
    assert result.returncode == 1 and "HTTP 401" in result.stderr and "admin token" in result.stderr
    result = run_pdctl(cluster, "set-role", "d0", "prefill", token="wrong")
    assert result.returncode == 1 and "HTTP 401" in result.stderr
    result = run_pdctl(cluster, "status", token="wrong")
    assert result.returncode == 1 and "HTTP 401" in result.stderr
    for path in ("/admin/drain", "/admin/role"):  # a worker takes signed calls only: the admin token is none
        with pytest.raises(Exception) as err:
            http_json(cluster.worker_url("d0") + path, "POST", b'{"role": "prefill"}', {"X-Admin-Token": TOKEN})
        assert err.value.code == 401

    assert roles(cluster) == before


def test_set_role_and_drain_round_trip(cluster):
    result = run_pdctl(cluster, "set-role", "d1", "both", "--wait")
    assert result.returncode == 0, result.stderr
    assert "d1: settled as both" in result.stdout
    assert roles(cluster)["d1"] == ("both", "active")
    result = run_pdctl(cluster, "drain", "d1", "--wait")
    assert result.returncode == 0, result.stderr
    assert roles(cluster)["d1"] == ("both", "idle")
    result = run_pdctl(cluster, "set-role", "d1", "decode", "--wait")  # also resumes it
    assert result.returncode == 0, result.stderr
    assert roles(cluster)["d1"] == ("decode", "active")


def test_rebalance_dry_run_then_apply(cluster):
    # The stack is idle, so a tiny TTFT target is what is "missed": every worker's recent TTFT is
    # from the requests below.  Run a few requests so the decoders have readings.
    import openai

    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="x", max_retries=0)
    for i in range(4):
        client.completions.create(model=cluster.model_name, prompt=f"warm up {i} " * 30, max_tokens=4, temperature=0)
    # The decoders' TTFT reaches the registry with their next heartbeat.
    deadline = time.monotonic() + 30
    while not any(w["recent_ttft_s"] for w in pool_entries(cluster) if w["role"] == "decode"):
        assert time.monotonic() < deadline, "no TTFT readings in the registry"
        time.sleep(0.1)
    # Stated prefill rate and a TTFT target no request can meet: one more prefill worker.
    args = ["rebalance", "--ttft-target", "1e-6", "--prefill-rate", "1e9"]
    dry = run_pdctl(cluster, *args)
    assert dry.returncode == 0, dry.stderr
    assert "TTFT" in dry.stdout and "dry run" in dry.stdout
    moves = [line for line in dry.stdout.splitlines() if line.startswith("move ")]
    assert len(moves) == 1 and moves[0].endswith(": decode -> prefill")
    assert roles(cluster) == {"p0": ("prefill", "active"), "d0": ("decode", "active"),
                              "d1": ("decode", "active")}  # a dry run changes nothing

    applied = run_pdctl(cluster, *args, "--apply")
    assert applied.returncode == 0, applied.stderr
    moves = [line for line in applied.stdout.splitlines() if line.startswith("move ")]
    assert len(moves) == 1 and moves[0].endswith(": decode -> prefill")  # the loads may pick the other one now
    moved = moves[0].split()[1].rstrip(":")
    assert f"{moved}: settled as prefill" in applied.stdout
    assert roles(cluster)[moved] == ("prefill", "active")
    health = http_json(f"{cluster.gateway_url}/health")
    assert health["workers"] == {"prefill": 2, "decode": 1, "both": 0}

    # The last decode worker is never moved away, however the targets read.
    again = run_pdctl(cluster, *args, "--apply")
    assert again.returncode == 0 and "no moves" in again.stdout
    assert run_pdctl(cluster, "set-role", moved, "decode", "--wait").returncode == 0
