"""The worker's flags: every one also reads PDSERVE_<FLAG>, bad values are named, bounds validated."""
from __future__ import annotations

import argparse

import pytest

from common.cluster.flags import RemovedFlag
from worker.config import build_parser, config_from_args, env_names


def env_value(action: argparse.Action) -> tuple[str, object]:
    """A value for ``action`` that differs from its default, as a string and as parsed."""
    if isinstance(action, argparse._StoreTrueAction):
        return "true", True
    if isinstance(action, argparse.BooleanOptionalAction):  # a switch that is on by default
        return "false", False
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return choice, choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "7.5", 7.5
    return "value-from-env", "value-from-env"


ACTIONS = [a for a in build_parser("decode", "test")._actions if a.dest != "help" and not isinstance(a, RemovedFlag)]


@pytest.mark.parametrize("action", ACTIONS, ids=[a.option_strings[0] for a in ACTIONS])
def test_every_flag_reads_its_environment_variable(action):
    raw, parsed = env_value(action)
    name = f"PDSERVE_{action.dest.upper()}"
    assert name in env_names()
    args = build_parser("decode", "test", env={name: raw}).parse_args([])
    assert getattr(args, action.dest) == parsed
    # The command line still wins, and an empty variable means unset.
    if not isinstance(action, argparse._StoreTrueAction):
        default = build_parser("decode", "test", env={}).parse_args([])
        assert getattr(build_parser("decode", "test", env={name: ""}).parse_args([]), action.dest) == \
            getattr(default, action.dest)


def test_flag_beats_variable_and_redis_url_alias():
    env = {"PDSERVE_NUM_BLOCKS": "64", "REDIS_URL": "redis://alias:1"}
    args = build_parser("decode", "test", env=env).parse_args(["--num-blocks", "32"])
    assert args.num_blocks == 32 and args.redis_url == "redis://alias:1"
    both = {"PDSERVE_REDIS_URL": "redis://flag-name:2", "REDIS_URL": "redis://alias:1"}
    assert build_parser("decode", "test", env=both).parse_args([]).redis_url == "redis://flag-name:2"


def test_bad_values_from_the_environment_are_named(capsys):
    with pytest.raises(SystemExit):
        build_parser("decode", "test", env={"PDSERVE_PORT": "eighty"}).parse_args([])
    assert "--port" in capsys.readouterr().err
    with pytest.raises(ValueError, match="PDSERVE_KV_CHECKSUM"):
        build_parser("decode", "test", env={"PDSERVE_KV_CHECKSUM": "maybe"})


def test_timeouts_reach_the_config_and_are_validated():
    args = build_parser("decode", "test", env={}).parse_args(
        ["--kv-timeout", "9", "--kv-connect-timeout", "2", "--kv-lease-timeout", "3", "--kv-abort-grace", "4",
         "--peer-connect-timeout", "1.5", "--control-timeout", "2.5"])
    config = config_from_args(args)
    assert (config.kv.transfer_timeout, config.kv.connect_timeout, config.kv.lease_timeout,
            config.kv.abort_grace) == (9, 2, 3, 4)
    assert (config.peer_connect_timeout_s, config.control_timeout_s) == (1.5, 2.5)
    with pytest.raises(ValueError, match="control_timeout_s"):
        config_from_args(build_parser("decode", "test", env={}).parse_args(["--control-timeout", "0"]))


def test_cuda_graphs_are_on_unless_turned_off():
    parse = lambda argv, env=None: config_from_args(build_parser("decode", "test", env=env or {}).parse_args(argv))
    assert parse([]).engine.cuda_graphs is True
    assert parse(["--no-cuda-graphs"]).engine.cuda_graphs is False
    assert parse([], {"PDSERVE_CUDA_GRAPHS": "0"}).engine.cuda_graphs is False
    assert parse(["--cuda-graphs"], {"PDSERVE_CUDA_GRAPHS": "off"}).engine.cuda_graphs is True
    assert parse(["--attention-backend", "triton"]).engine.attention_backend == "triton"


def test_compile_is_on_unless_turned_off():
    parse = lambda argv, env=None: config_from_args(build_parser("decode", "test", env=env or {}).parse_args(argv))
    assert parse([]).engine.compile is True
    assert parse(["--no-compile"]).engine.compile is False
    assert parse([], {"PDSERVE_COMPILE": "0"}).engine.compile is False


# ---- the Redis password: never printed, readable from a file -------------------------------------

REDIS_PASSWORD = "redis-pw-0123456789abcdef"


def test_help_and_repr_never_show_the_redis_password(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # no line breaks inside a value
    env = {"REDIS_URL": f"redis://:{REDIS_PASSWORD}@redis.internal:6379/0"}
    parser = build_parser("decode", "test", env=env)
    text = parser.format_help()
    assert REDIS_PASSWORD not in text and "redis://***@redis.internal:6379/0" in text
    config = config_from_args(parser.parse_args([]))
    assert REDIS_PASSWORD in config.redis_url  # what the worker connects with
    assert REDIS_PASSWORD not in repr(config)


def test_the_redis_password_reads_from_a_file(tmp_path):
    path = tmp_path / "redis-password"
    path.write_text(REDIS_PASSWORD + "\n")
    env = {"REDIS_URL": "redis://redis.internal:6379/0", "PDSERVE_REDIS_PASSWORD_FILE": str(path)}
    config = config_from_args(build_parser("decode", "test", env=env).parse_args([]))
    assert config.redis_url == f"redis://:{REDIS_PASSWORD}@redis.internal:6379/0"
    with pytest.raises(ValueError, match="cannot read the Redis password from the file"):
        config_from_args(build_parser("decode", "test", env={}).parse_args(
            ["--redis-password-file", str(tmp_path / "missing")]))


@pytest.mark.parametrize("argv", [["--admin-token", "old-admin-token-0123456789"], ["--admin-token=old-admin-token-0123456789"]])
def test_the_removed_admin_token_flag_is_refused_without_echoing_its_value(capsys, argv):
    """Workers take signed admin calls only; an old command line must not print the token it holds."""
    with pytest.raises(SystemExit) as exit_:
        build_parser("decode", "pdserve worker").parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--admin-token is no longer taken" in err
    assert "old-admin-token" not in err
    assert "--admin-token" not in build_parser("decode", "pdserve worker").format_help()


def test_core_turns_reach_the_config_and_make_up_sets_them_for_cpu_workers(monkeypatch):
    from launcher.run import build_parser as launcher_parser, core_turns_path, stack_from_args

    parse = lambda argv, env=None: config_from_args(build_parser("decode", "test", env=env or {}).parse_args(argv))
    assert parse([]).core_turns is None
    assert parse(["--core-turns", "/run/turns.lock"]).core_turns == "/run/turns.lock"
    assert parse([], {"PDSERVE_CORE_TURNS": "/run/t.lock"}).core_turns == "/run/t.lock"

    def make_up_args():
        stack = stack_from_args(launcher_parser(env={}).parse_args(["--key-prefix", "p1"]), "redis://127.0.0.1:6379/0")
        return stack.worker_command("d0", "decode", 9999)[1]

    monkeypatch.setenv("PDSERVE_DEVICE", "cpu")
    args = make_up_args()
    assert args[args.index("--core-turns") + 1] == str(core_turns_path("p1"))
    assert core_turns_path("p1") != core_turns_path("p2")  # stacks apart take turns apart
    monkeypatch.setenv("PDSERVE_DEVICE", "cuda")
    assert "--core-turns" not in make_up_args()
