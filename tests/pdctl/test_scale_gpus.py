"""``pdctl scale --gpus N``: the workers asked for must fit the host's GPUs, each taking its pool's
tensor-parallel size (``PDSERVE_PREFILL_TP`` / ``PDSERVE_DECODE_TP``, from the shell or the env file,
as compose resolves them)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdctl.deploy import cli as deploy_cli
from pdctl.deploy.env_file import build_env, write_env_file


def scale_args(env_file, prefill: int, decode: int, gpus: int) -> SimpleNamespace:
    return SimpleNamespace(gpus=gpus, prefill=prefill, decode=decode, allow_outage=False, run=False,
                           env_file=str(env_file))


@pytest.fixture
def env_file(tmp_path, monkeypatch):
    for name in ("PDSERVE_PREFILL_TP", "PDSERVE_DECODE_TP"):
        monkeypatch.delenv(name, raising=False)

    def write(**settings):
        return write_env_file(tmp_path / "compose.env", build_env("gpu", settings=settings), force=True)

    return write


class Planned(Exception):
    """Raised by the stand-in operator: the GPU check let the command through."""


@pytest.fixture
def no_operator(monkeypatch):
    def operator(client, args):
        raise Planned()

    monkeypatch.setattr(deploy_cli, "operator", operator)


def test_tensor_parallel_workers_count_all_their_gpus(env_file, no_operator):
    path = env_file(PDSERVE_DECODE_TP="2")
    with pytest.raises(ValueError, match=r"--prefill 2 x 1 GPU\(s\) \+ --decode 2 x 2 GPU\(s\).* = 6 GPUs, more than "
                                         r"the 4"):
        deploy_cli.cmd_scale(None, scale_args(path, 2, 2, gpus=4))
    with pytest.raises(Planned):  # 2 x 1 + 1 x 2 = 4 fits
        deploy_cli.cmd_scale(None, scale_args(path, 2, 1, gpus=4))


def test_without_tensor_parallelism_a_worker_takes_one_gpu(env_file, no_operator):
    path = env_file()
    with pytest.raises(Planned):
        deploy_cli.cmd_scale(None, scale_args(path, 2, 2, gpus=4))
    with pytest.raises(ValueError, match="5 GPUs, more than the 4"):
        deploy_cli.cmd_scale(None, scale_args(path, 3, 2, gpus=4))


def test_the_shell_variable_wins_as_in_compose(env_file, no_operator, monkeypatch):
    path = env_file(PDSERVE_PREFILL_TP="1")
    monkeypatch.setenv("PDSERVE_PREFILL_TP", "4")
    with pytest.raises(ValueError, match="= 9 GPUs, more than the 8"):
        deploy_cli.cmd_scale(None, scale_args(path, 2, 1, gpus=8))
    monkeypatch.setenv("PDSERVE_PREFILL_TP", "two")
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_TP='two'"):
        deploy_cli.cmd_scale(None, scale_args(path, 1, 1, gpus=8))
