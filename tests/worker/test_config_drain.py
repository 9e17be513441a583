"""The drain timeouts' defaults are declared once, as WorkerConfig fields (like the worker's other
settings), and their flags and PDSERVE_* variables reach the config."""
from __future__ import annotations

import dataclasses

import pytest

from worker.config import WorkerConfig, build_parser, config_from_args

SECRET = "s" * 40
SETTINGS = [("drain_timeout", "--drain-timeout", "PDSERVE_DRAIN_TIMEOUT"),
            ("failure_drain_timeout", "--failure-drain-timeout", "PDSERVE_FAILURE_DRAIN_TIMEOUT")]


@pytest.mark.parametrize("name, flag, variable", SETTINGS)
def test_the_default_is_the_config_fields(name, flag, variable):
    fields = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    args = build_parser("decode", "test", env={}).parse_args([])
    assert getattr(args, name) == fields[f"{name}_s"]


@pytest.mark.parametrize("name, flag, variable", SETTINGS)
def test_the_flag_and_the_variable_reach_the_config(tmp_path, name, flag, variable):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    base = ["--model", "m", "--cluster-secret-file", str(secret)]
    parser = build_parser("decode", "test", env={variable: "45"})
    assert getattr(config_from_args(parser.parse_args(base)), f"{name}_s") == 45.0
    assert getattr(config_from_args(parser.parse_args([*base, flag, "7"])), f"{name}_s") == 7.0
    with pytest.raises(ValueError, match=f"{name}_s must be >= 0"):
        config_from_args(parser.parse_args([*base, flag, "-1"]))
