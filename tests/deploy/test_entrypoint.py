"""compose/entrypoint.py: secrets, GPU claims that never fall back to the CPU, surplus replicas,
the HCA and CPUs nearest each GPU from an `nvidia-smi topo -m` sample, UCX devices and ports.

Unit tests drive ``prepare`` with a recorded host (``FakeHost``); the process tests run the real
entrypoint with a stand-in ``nvidia-smi`` on PATH that prints the same samples.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.local_stack import ROOT
from tests.support.entrypoint_host import (  # noqa: F401 (ep, runtime_file: fixtures)
    COMPOSE, SIBLINGS, STRONG, TOPO_8GPU, TOPO_OLD_SWITCH, FakeHost, ep, release, runtime_file, worker_env,
)

# ---- topology parsing --------------------------------------------------------------------------


def test_topology_sample_parses(ep):
    topo = ep.topo_mod.parse_topology(TOPO_8GPU)
    assert topo.gpus == [str(i) for i in range(8)]
    assert topo.nics == [f"mlx5_{i}" for i in range(9)]
    assert topo.links["5"]["mlx5_5"] == "PIX" and topo.links["5"]["mlx5_0"] == "SYS"
    assert topo.cpus["0"] == [0, 1, 2, 3, 8, 9, 10, 11] and topo.numa["6"] == "1"
    old = ep.topo_mod.parse_topology(TOPO_OLD_SWITCH)
    assert old.nics == ["mlx5_0", "mlx5_1"] and old.numa["0"] is None and old.cpus["1"] == list(range(8))
    with pytest.raises(ep.topo_mod.TopologyError, match="GPU0"):
        ep.topo_mod.parse_topology("No devices were found")


def test_each_gpu_gets_its_nearest_hca(ep):
    topo = ep.topo_mod.parse_topology(TOPO_8GPU)
    assert [ep.topo_mod.nearest_hca(topo, str(g)) for g in range(8)] == [f"mlx5_{g}" for g in range(8)]
    # Only the management NIC allowed: it is NODE-close to GPUs 0-3 and across the socket for 4-7.
    assert ep.topo_mod.nearest_hca(topo, "1", ["mlx5_8"]) == "mlx5_8"
    assert ep.topo_mod.nearest_hca(topo, "5", ["mlx5_8"]) is None
    # Equally close HCAs are shared out, one per GPU.
    old = ep.topo_mod.parse_topology(TOPO_OLD_SWITCH)
    assert [ep.topo_mod.nearest_hca(old, g) for g in ("0", "1")] == ["mlx5_0", "mlx5_1"]
    assert ep.topo_mod.parse_hca_map("0=mlx5_3:1, 1=mlx5_2:2") == {"0": "mlx5_3:1", "1": "mlx5_2:2"}
    with pytest.raises(ep.topo_mod.TopologyError, match="GPU=HCA"):
        ep.topo_mod.parse_hca_map("mlx5_0")


def test_cpu_share_is_whole_cores_of_the_gpus_numa_node(ep):
    topo = ep.topo_mod.parse_topology(TOPO_8GPU)
    every = [str(g) for g in range(8)]
    assert ep.topo_mod.cpu_share(topo, "0", every, set(range(16)), SIBLINGS) == ([0, 8], 1)
    assert ep.topo_mod.cpu_share(topo, "6", every, set(range(16)), SIBLINGS) == ([6, 14], 1)
    # Two workers on socket 0 split its four cores; a container cpuset limits the choice.
    assert ep.topo_mod.cpu_share(topo, "1", ["0", "1"], set(range(16)), SIBLINGS) == ([2, 3, 10, 11], 2)
    assert ep.topo_mod.cpu_share(topo, "0", ["0"], {0, 1, 8}, SIBLINGS) == ([0, 1, 8], 2)
    assert ep.topo_mod.format_cpu_list([0, 1, 2, 8, 10, 11]) == "0-2,8,10-11"
    assert ep.topo_mod.parse_cpu_list("0-2,8,10-11") == [0, 1, 2, 8, 10, 11]


# ---- GPU claims: real GPUs only, surplus replicas step aside --------------------------------------


def test_a_worker_without_a_real_gpu_refuses_instead_of_running_on_the_cpu(ep, tmp_path):
    with pytest.raises(ep.Refusal, match="sees no GPU.*rather than serve from the CPU"):
        ep.prepare("decode_svc", worker_env(tmp_path), FakeHost(gpus=()))
    for device in ("", "auto", "cuda:3"):
        with pytest.raises(ep.Refusal, match="PDSERVE_DEVICE"):
            ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_DEVICE=device), FakeHost())
    # The default 8-GPU list on a 4-GPU host names GPUs that do not exist.
    with pytest.raises(ep.Refusal, match=r"GPU\(s\) 4,5,6,7 that this host does not have \(it has 0,1,2,3\)"):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_GPUS="0,1,2,3,4,5,6,7"), FakeHost(gpus="0123"))
    with pytest.raises(ep.Refusal, match="PDSERVE_GPUS is set but PDSERVE_DEVICE=cpu"):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_DEVICE="cpu", PDSERVE_GPUS="0"), FakeHost())


def test_replicas_claim_distinct_gpus_and_the_surplus_one_steps_aside(ep, tmp_path):
    host = FakeHost(gpus="0123", topology=None)
    launches, envs = [], []
    for _ in range(4):
        env = worker_env(tmp_path)
        launches.append(ep.prepare("prefill_svc", env, host))
        envs.append(env)
    assert [e["PDSERVE_GPU"] for e in envs] == ["0", "1", "2", "3"]
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == "2,0,1,3" and envs[2]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert envs[2]["PDSERVE_DEVICE"] == "cuda" and envs[2]["PDSERVE_WORKER_ID"].endswith("-gpu2")
    assert (envs[3]["PDSERVE_PORT"], envs[3]["PDSERVE_KV_PORT"]) == ("8103", "8203")
    with pytest.raises(ep.Surplus, match="surplus"):
        ep.prepare("prefill_svc", worker_env(tmp_path), host)
    release(launches.pop(1))  # that worker exited: its GPU is free for the next replica
    env = worker_env(tmp_path, PDSERVE_GPU_ISOLATION="1")
    launches.append(ep.prepare("decode_svc", env, host))
    assert env["PDSERVE_GPU"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    for launch in launches:
        release(launch)


def test_cpu_workers_claim_cpu_sets(ep, tmp_path):
    host = FakeHost(cpus=range(8))
    env = worker_env(tmp_path, PDSERVE_DEVICE="cpu", PDSERVE_CPUSETS="0-1;2-3", PDSERVE_KV_TRANSPORT="tcp")
    first = ep.prepare("decode_svc", env, host)
    second_env = worker_env(tmp_path, PDSERVE_DEVICE="cpu", PDSERVE_CPUSETS="0-1;2-3", PDSERVE_KV_TRANSPORT="tcp")
    second = ep.prepare("decode_svc", second_env, host)
    assert (first.cpus, second.cpus) == ([0, 1], [2, 3]) and second_env["OMP_NUM_THREADS"] == "2"
    assert "PDSERVE_CORE_TURNS" not in env  # cores of its own: no turns to take
    with pytest.raises(ep.Surplus):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_DEVICE="cpu", PDSERVE_CPUSETS="0-1;2-3"), host)
    release(first)
    release(second)


def test_cpu_workers_without_cpu_sets_take_turns_on_the_shared_cores(ep, tmp_path):
    envs = [worker_env(tmp_path, PDSERVE_DEVICE="cpu", PDSERVE_KV_TRANSPORT="tcp") for _ in range(2)]
    launches = [ep.prepare("decode_svc", env, FakeHost(cpus=range(2))) for env in envs]
    assert envs[0]["PDSERVE_CORE_TURNS"] == envs[1]["PDSERVE_CORE_TURNS"]  # one lock file in the shared lock volume
    assert envs[0]["PDSERVE_CORE_TURNS"].startswith(envs[0].get("PDSERVE_LOCK_DIR") or "/run/pdserve-locks")
    for launch in launches:
        release(launch)


def cpu_compose_worker_env(tmp_path, **settings) -> dict[str, str]:
    """The CPU compose file's decode worker environment, rendered from a gen-secrets env file plus ``settings``."""
    from tests.support.compose_render import env_files, env_values, load_stack

    spec = load_stack("cpu", {**env_values(env_files(), "cpu"), **settings})["services"]["decode"]
    env = {k: "" if v is None else v for k, v in spec["environment"].items()}
    return {**env, "PDSERVE_LOCK_DIR": str(tmp_path / "locks"), "PDSERVE_ADVERTISE_HOST": "10.0.0.12"}


def test_the_cpu_compose_file_leaves_omp_threads_to_the_entrypoint(ep, tmp_path):
    """Each worker's OMP_NUM_THREADS is its CPU set's size; sharing the cores, 2 threads each."""
    host = FakeHost(cpus=range(8))
    env = cpu_compose_worker_env(tmp_path, PDSERVE_CPUSETS="0-3;4-7")
    launch = ep.prepare("decode_svc", env, host)
    assert launch.cpus == [0, 1, 2, 3] and env["OMP_NUM_THREADS"] == "4"
    release(launch)
    shared = cpu_compose_worker_env(tmp_path / "shared")
    launch = ep.prepare("decode_svc", shared, host)
    assert "PDSERVE_CORE_TURNS" in shared and shared["OMP_NUM_THREADS"] == str(ep.SHARED_CORES_OMP_THREADS) == "2"
    release(launch)
    mine = cpu_compose_worker_env(tmp_path / "mine", PDSERVE_CPUSETS="0-3;4-7", OMP_NUM_THREADS="3")
    release(ep.prepare("decode_svc", mine, host))
    assert mine["OMP_NUM_THREADS"] == "3"  # the operator's own setting wins


# ---- NICs, HCAs, UCX ports -----------------------------------------------------------------------


def test_auto_devices_are_the_nearest_hca_and_the_cluster_nic(ep, tmp_path):
    host = FakeHost()
    launches, envs = [], []
    for _ in range(3):
        env = worker_env(tmp_path, UCX_TLS="rc,cuda_ipc,cuda_copy,sm,tcp", UCX_NET_DEVICES="auto",
                         PDSERVE_NETWORK_MODE="host")
        launches.append(ep.prepare("decode_svc", env, host))
        envs.append(env)
    assert [e["UCX_NET_DEVICES"] for e in envs] == ["mlx5_0:1,ens1f0", "mlx5_1:1,ens1f0", "mlx5_2:1,ens1f0"]
    assert [e["UCX_TCP_PORT_RANGE"] for e in envs] == ["8300-8315", "8316-8331", "8332-8347"]
    assert launches[2].cpus == [2, 10] and envs[2]["OMP_NUM_THREADS"] == "1"
    assert launches[2].prefix == ["numactl", "--preferred=0"]
    assert any("RDMA: mlx5_2:1 for GPU 2" in note for note in launches[2].notes)
    for launch in launches:
        release(launch)


def test_operator_maps_and_hca_limits_win(ep, tmp_path):
    host = FakeHost()
    env = worker_env(tmp_path, UCX_TLS="rc,sm,tcp", PDSERVE_HCA_MAP="0=mlx5_7:2,1=mlx5_6:1", PDSERVE_GPUS="0,1")
    launch = ep.prepare("decode_svc", env, host)
    assert env["UCX_NET_DEVICES"] == "mlx5_7:2,ens1f0"
    release(launch)
    # The compute fabric is mlx5_0..3 only: GPU 4 (other socket) gets no HCA and keeps TCP.
    env = worker_env(tmp_path, UCX_TLS="rc,sm,tcp", PDSERVE_HCAS="mlx5_0,mlx5_1,mlx5_2,mlx5_3", PDSERVE_GPUS="4")
    launch = ep.prepare("decode_svc", env, host)
    assert env["UCX_NET_DEVICES"] == "ens1f0"
    assert any("KV to other hosts goes over TCP" in n for n in launch.notes)
    release(launch)
    env = worker_env(tmp_path, UCX_TLS="rc,sm,tcp", PDSERVE_HCA_MAP="1=mlx5_1", PDSERVE_GPUS="0")
    with pytest.raises(ep.Refusal, match="no entry for GPU 0"):
        ep.prepare("decode_svc", env, host)


def test_single_host_uses_the_containers_interface_only(ep, tmp_path):
    host = FakeHost(interfaces={"lo": "127.0.0.1", "eth0": "172.20.0.5"})
    env = worker_env(tmp_path, UCX_TLS="cuda_ipc,cuda_copy,sm,tcp", PDSERVE_ADVERTISE_HOST="172.20.0.5")
    launch = ep.prepare("decode_svc", env, host)
    assert env["UCX_NET_DEVICES"] == "eth0"  # no RDMA wanted, no HCA offered
    release(launch)


def test_unsafe_net_devices_are_refused(ep, tmp_path):
    cases = [("all", "offers every interface"), ("mlx5_0:1,docker0", "other hosts cannot reach"),
             ("veth12ab", "other hosts cannot reach"), ("mlx5_0:1", "no TCP interface")]
    for value, message in cases:
        with pytest.raises(ep.Refusal, match=message):
            ep.prepare("decode_svc", worker_env(tmp_path, UCX_NET_DEVICES=value, UCX_TLS="rc,sm,tcp"), FakeHost())
    launch = ep.prepare("decode_svc", worker_env(tmp_path, UCX_NET_DEVICES="mlx5_0:1", UCX_TLS="rc,sm"), FakeHost())
    release(launch)  # RDMA only, on purpose: allowed
    # On the host network an advertised address on a bridge is a mistake.
    env = worker_env(tmp_path, PDSERVE_ADVERTISE_HOST="172.17.0.1", PDSERVE_NETWORK_MODE="host")
    with pytest.raises(ep.Refusal, match="bridge other hosts cannot reach"):
        ep.prepare("decode_svc", env, FakeHost())
    with pytest.raises(ep.Refusal, match="PDSERVE_TCP_NIC"):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_ADVERTISE_HOST="10.9.9.9"), FakeHost())


def test_empty_tool_variables_are_dropped(ep, tmp_path):
    env = worker_env(tmp_path, UCX_IB_GID_INDEX="", OMP_NUM_THREADS="", HF_TOKEN="")
    launch = ep.prepare("decode_svc", env, FakeHost())
    assert "UCX_IB_GID_INDEX" not in env and "HF_TOKEN" not in env and env["OMP_NUM_THREADS"] == "1"
    release(launch)


def test_real_interfaces_include_loopback(ep):
    interfaces = ep.HostProbe().interfaces()
    assert interfaces.get("lo") == "127.0.0.1"
    assert ep.interface_for("127.0.0.1", interfaces) == "lo"


UCX_INFO_SAMPLE = """\
#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  8:rc_mlx5/mlx5_0:1.0 md[4]      -> md[4]/ib/sysdev[255] rma_bw#0 am am_bw#0
#                 lane[1]:  3:tcp/ens1f0.0 md[1]            -> md[1]/tcp/sysdev[255] rma_bw#1 wireup
"""


def test_ucx_lanes_are_reported(ep, monkeypatch):
    assert ep.ucx_lanes(UCX_INFO_SAMPLE) == ["rc_mlx5/mlx5_0:1", "tcp/ens1f0"]
    libucx = importlib.util.find_spec("libucx")
    ucx_bin = Path(libucx.origin).parent / "bin" if libucx else None
    if ucx_bin is None or not (ucx_bin / "ucx_info").exists():
        pytest.skip("no ucx_info here (the GPU image has it on PATH)")
    env = {"PATH": f"{ucx_bin}:{os.environ['PATH']}", "LD_LIBRARY_PATH": str(ucx_bin.parent / "lib"),
           "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    line = ep.report_ucx(env)
    assert "libucs" in line and "inter-host lanes: tcp/lo" in line, line


# ---- secrets, drain, runtime file -------------------------------------------------------------------


@pytest.mark.parametrize("module, name", [("decode_svc", "PDSERVE_CLUSTER_SECRET"), ("gateway", "PDSERVE_CLUSTER_SECRET"),
                                          ("gateway", "PDSERVE_ADMIN_TOKEN")])
@pytest.mark.parametrize("value", ["", "change-me", "change-me-too-long-enough", "short-but-real"])
def test_placeholder_and_weak_secrets_are_refused(ep, tmp_path, module, name, value):
    env = worker_env(tmp_path, **{name: value}) if module != "gateway" else \
        {**STRONG, "PDSERVE_API_KEY": "sk-" + "z" * 40, name: value}
    with pytest.raises(ep.Refusal, match=f"{name} is not usable.*pdctl gen-secrets"):
        ep.prepare(module, env, FakeHost())


def test_workers_take_no_admin_token(ep, tmp_path):
    """The admin token never leaves the gateway (workers take signed admin calls): a worker starts
    without one, and one given to it anyway is pointed out."""
    env = worker_env(tmp_path, PDSERVE_KV_TRANSPORT="tcp")
    assert "PDSERVE_ADMIN_TOKEN" not in env
    release(ep.prepare("decode_svc", env, FakeHost()))
    launch = ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_KV_TRANSPORT="tcp", PDSERVE_ADMIN_TOKEN="a" * 32),
                        FakeHost())
    release(launch)
    assert any("a worker takes no admin token" in note for note in launch.notes)


def test_redis_password_and_api_key_are_checked(ep, tmp_path):
    with pytest.raises(ep.Refusal, match="Redis password"):
        ep.prepare("gateway", {**STRONG, "REDIS_URL": "redis://:change-me@redis:6379/0", "PDSERVE_API_KEY": "x" * 40})
    with pytest.raises(ep.Refusal, match="PDSERVE_API_KEY is not usable: it is empty.*PDSERVE_ALLOW_NO_API_KEY=1"):
        ep.prepare("gateway", dict(STRONG))
    env = {**STRONG, "PDSERVE_ALLOW_NO_API_KEY": "1", "PDSERVE_GATEWAY_PORT": "8123"}
    launch = ep.prepare("gateway", env)
    assert any("needs no key" in n for n in launch.notes) and env["PDSERVE_GATEWAY_HOST"] == "0.0.0.0"
    with pytest.raises(ep.Refusal, match="PDSERVE_API_KEY"):
        ep.prepare("gateway", {**STRONG, "PDSERVE_API_KEY": "change-me-please"})
    launch = ep.prepare("gateway", {**STRONG, "PDSERVE_API_KEY": "sk-" + "z" * 40, "REDIS_URL": "redis://127.0.0.1"})
    assert launch.lock_fds == []


def test_every_secret_may_come_from_a_file(ep, tmp_path):
    files = {"PDSERVE_CLUSTER_SECRET_FILE": "k" * 32, "PDSERVE_ADMIN_TOKEN_FILE": "a" * 32,
             "PDSERVE_REDIS_PASSWORD_FILE": "r" * 24, "PDSERVE_API_KEYS_FILE": "sk-" + "z" * 40}
    env = {"REDIS_URL": "redis://redis:6379/0", "PDSERVE_GATEWAY_PORT": "8123"}
    for name, value in files.items():
        (tmp_path / name).write_text(value + "\n")
        env[name] = str(tmp_path / name)
    ep.prepare("gateway", dict(env))  # no secret in the environment itself, and nothing refused
    (tmp_path / "weak").write_text("change-me\n")
    with pytest.raises(ep.Refusal, match="PDSERVE_ADMIN_TOKEN is not usable: it is a placeholder"):
        ep.prepare("gateway", {**env, "PDSERVE_ADMIN_TOKEN_FILE": str(tmp_path / "weak")})
    with pytest.raises(ep.Refusal, match="Redis password.*not usable"):
        ep.prepare("gateway", {**env, "PDSERVE_REDIS_PASSWORD_FILE": str(tmp_path / "weak")})
    with pytest.raises(ep.Refusal, match="cannot read PDSERVE_CLUSTER_SECRET from the file .*missing"):
        ep.prepare("gateway", {**env, "PDSERVE_CLUSTER_SECRET_FILE": str(tmp_path / "missing")})


def test_an_admin_token_equal_to_the_cluster_secret_is_refused(ep):
    same = {"PDSERVE_CLUSTER_SECRET": "s" * 32, "PDSERVE_ADMIN_TOKEN": "s" * 32, "PDSERVE_API_KEY": "sk-" + "z" * 40}
    with pytest.raises(ep.Refusal, match="PDSERVE_ADMIN_TOKEN and PDSERVE_CLUSTER_SECRET are the same value") as err:
        ep.prepare("gateway", same)
    assert "s" * 32 not in str(err.value)


def test_workers_on_the_host_network_bind_only_the_advertised_address(ep, tmp_path, runtime_file):
    env = worker_env(tmp_path, PDSERVE_NETWORK_MODE="host", PDSERVE_KV_TRANSPORT="tcp")
    release(ep.prepare("decode_svc", env, FakeHost()))
    assert env["PDSERVE_HOST"] == "10.0.0.12"  # HTTP, and KV (--kv-host defaults to --host)
    assert json.loads(runtime_file.read_text())["health_url"] == "http://10.0.0.12:8100/health"
    # In its own network namespace a container binds all of it; the health check uses loopback.
    env = worker_env(tmp_path, PDSERVE_KV_TRANSPORT="tcp")
    release(ep.prepare("decode_svc", env, FakeHost()))
    assert env["PDSERVE_HOST"] == "0.0.0.0"
    assert json.loads(runtime_file.read_text())["health_url"] == "http://127.0.0.1:8100/health"


def test_stop_grace_must_cover_the_drain(ep, tmp_path):
    assert ep.parse_duration("2m30s") == 150 and ep.parse_duration("150") == 150
    with pytest.raises(ep.Refusal, match="does not cover PDSERVE_DRAIN_TIMEOUT=120"):
        ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_STOP_GRACE="60s", PDSERVE_DRAIN_TIMEOUT="120"), FakeHost())
    launch = ep.prepare("decode_svc", worker_env(tmp_path, PDSERVE_STOP_GRACE="2m30s", PDSERVE_DRAIN_TIMEOUT="120"),
                        FakeHost())
    release(launch)


def test_runtime_file_tells_pdctl_which_worker_runs_here(ep, tmp_path, runtime_file):
    env = worker_env(tmp_path, PDSERVE_WORKER_ID="h1-gpu0")
    launch = ep.prepare("decode_svc", env, FakeHost())
    info = json.loads(runtime_file.read_text())
    assert info["worker_id"] == "h1-gpu0" and info["gpu"] == "0" and info["health_url"] == "http://127.0.0.1:8100/health"
    release(launch)
    assert ep.health() == 1  # nothing listens there


# ---- the real entrypoint process ---------------------------------------------------------------------


@pytest.fixture
def fake_nvidia_smi(tmp_path):
    """A stand-in `nvidia-smi` on PATH printing the 8-GPU samples (GPU count from $FAKE_GPUS)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "topo.txt").write_text(TOPO_8GPU)
    script = bin_dir / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in
  topo) cat {tmp_path / 'topo.txt'} ;;
  --query-gpu=index) i=0; while [ $i -lt ${{FAKE_GPUS:-8}} ]; do echo $i; i=$((i+1)); done ;;
  *) exit 9 ;;
esac
""")
    script.chmod(0o755)
    return bin_dir


def run_entrypoint(tmp_path, bin_dir, *args, **env) -> subprocess.CompletedProcess:
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PDSERVE_RUNTIME_FILE": str(tmp_path / "rt.json"),
            **worker_env(tmp_path, PDSERVE_KV_TRANSPORT="tcp"), **env}
    return subprocess.run([sys.executable, str(COMPOSE / "entrypoint.py"), *args], capture_output=True, text=True,
                          env=base, timeout=120)


def test_process_refuses_with_exit_78_and_surplus_exits_0(tmp_path, fake_nvidia_smi):
    result = run_entrypoint(tmp_path, fake_nvidia_smi, "decode_svc", FAKE_GPUS="4", PDSERVE_GPUS="0,1,2,3,4,5,6,7")
    assert result.returncode == 78 and "GPU(s) 4,5,6,7 that this host does not have" in result.stderr
    result = run_entrypoint(tmp_path, fake_nvidia_smi, "decode_svc", PDSERVE_CLUSTER_SECRET="change-me")
    assert result.returncode == 78 and "pdctl gen-secrets" in result.stderr
    # Every GPU held (by this test's own locks): the replica is surplus, says so, exits 0.
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    import fcntl

    held = []
    for gpu in range(2):
        f = open(lock_dir / f"gpu-{gpu}.lock", "w")
        fcntl.flock(f, fcntl.LOCK_EX)
        held.append(f)
    result = run_entrypoint(tmp_path, fake_nvidia_smi, "decode_svc", FAKE_GPUS="2")
    assert result.returncode == 0 and "surplus" in result.stdout, result.stderr
    for f in held:
        f.close()


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh for the stand-in nvidia-smi")
def test_process_claims_pins_and_execs_the_worker(tmp_path, fake_nvidia_smi):
    result = run_entrypoint(tmp_path, fake_nvidia_smi, "decode_svc", "--help", PDSERVE_WORKER_ID="w-gpu0")
    assert result.returncode == 0, result.stderr
    assert "entrypoint: GPU 0 (slot 0 of 0,1,2,3,4,5,6,7)" in result.stdout
    assert "usage:" in result.stdout  # the worker's own --help: exec happened
    info = json.loads((tmp_path / "rt.json").read_text())
    assert info["worker_id"] == "w-gpu0" and info["slot"] == 0
    whoami = subprocess.run([sys.executable, str(COMPOSE / "entrypoint.py"), "--whoami"], capture_output=True,
                            text=True, env={"PDSERVE_RUNTIME_FILE": str(tmp_path / "rt.json"), "PYTHONPATH": str(ROOT)})
    assert json.loads(whoami.stdout)["worker_id"] == "w-gpu0"
