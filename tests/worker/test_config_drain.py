"""--drain-timeout's default is declared once, as WorkerConfig.drain_timeout_s (like the worker's
other settings), and the flag and PDSERVE_DRAIN_TIMEOUT reach the config."""
from __future__ import annotations

import dataclasses

import pytest

from worker.config import WorkerConfig, build_parser, config_from_args

SECRET = "s" * 40


def test_the_drain_timeout_default_is_the_config_fields():
    fields = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    args = build_parser("decode", "test", env={}).parse_args([])
    assert args.drain_timeout == fields["drain_timeout_s"]


def test_the_flag_and_the_variable_reach_the_config(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    base = ["--model", "m", "--cluster-secret-file", str(secret)]
    parser = build_parser("decode", "test", env={"PDSERVE_DRAIN_TIMEOUT": "45"})
    assert config_from_args(parser.parse_args(base)).drain_timeout_s == 45.0
    assert config_from_args(parser.parse_args([*base, "--drain-timeout", "7"])).drain_timeout_s == 7.0
    with pytest.raises(ValueError, match="drain_timeout_s must be >= 0"):
        config_from_args(parser.parse_args([*base, "--drain-timeout", "-1"]))
