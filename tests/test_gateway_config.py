"""The gateway's flags: every one also reads PDSERVE_<FLAG>; old variable names stay aliases."""
from __future__ import annotations

import pytest

from gateway.config import GatewayConfig, build_parser, config_from_args, env_names

# A valid non-default value for each flag, as an environment variable would carry it.
SAMPLE = {"int": "7", "float": "3.5", "str": "x-value"}
CHOICES = {"routing_policy": "least_load", "cache_isolation": "per-key"}


def flag_actions():
    return [a for a in build_parser({})._actions if a.dest != "help"]


def test_every_flag_reads_pdserve_flag():
    actions = flag_actions()
    env = {}
    for a in actions:
        kind = {int: "int", float: "float"}.get(a.type, "str")
        env[f"PDSERVE_{a.dest.upper()}"] = CHOICES.get(a.dest, SAMPLE[kind])
    args = build_parser(env).parse_args([])
    for a in actions:
        raw = env[f"PDSERVE_{a.dest.upper()}"]
        expected = a.type(raw) if a.type in (int, float) else raw
        assert getattr(args, a.dest) == expected, f"--{a.dest} does not read PDSERVE_{a.dest.upper()}"
    assert "PDSERVE_HOST" in env_names() and "PDSERVE_MAX_INFLIGHT" in env_names()


def test_aliases_and_precedence():
    # The compose files set PDSERVE_GATEWAY_PORT/HOST; REDIS_URL is what every service reads.
    old = build_parser({"PDSERVE_GATEWAY_PORT": "9000", "PDSERVE_GATEWAY_HOST": "0.0.0.0",
                        "REDIS_URL": "redis://r:1"}).parse_args([])
    assert (old.port, old.host, old.redis_url) == (9000, "0.0.0.0", "redis://r:1")
    both = build_parser({"PDSERVE_PORT": "9001", "PDSERVE_GATEWAY_PORT": "9000"}).parse_args([])
    assert both.port == 9001
    flag = build_parser({"PDSERVE_PORT": "9001"}).parse_args(["--port", "9002"])
    assert flag.port == 9002
    empty = build_parser({"PDSERVE_PORT": "", "PDSERVE_MAX_INFLIGHT": ""}).parse_args([])
    assert (empty.port, empty.max_inflight) == (8000, 512)


def test_config_from_env_is_validated():
    config = config_from_args(build_parser({"PDSERVE_MAX_INFLIGHT": "9"}).parse_args([]))
    assert isinstance(config, GatewayConfig) and config.max_inflight == 9
    with pytest.raises(ValueError, match="routing_policy"):
        config_from_args(build_parser({"PDSERVE_ROUTING_POLICY": "random"}).parse_args([]))
    with pytest.raises(ValueError, match="max_inflight"):
        config_from_args(build_parser({"PDSERVE_MAX_INFLIGHT": "0"}).parse_args([]))


def test_cache_isolation_per_key_needs_api_keys():
    env = {"PDSERVE_CACHE_ISOLATION": "per-key"}
    with pytest.raises(ValueError, match="cache_isolation per-key needs API keys"):
        config_from_args(build_parser(env).parse_args([]))
    config = config_from_args(build_parser({**env, "PDSERVE_API_KEY": "sk-0123456789"}).parse_args([]))
    assert config.cache_isolation == "per-key"
    assert config_from_args(build_parser({}).parse_args([])).cache_isolation == "none"
    with pytest.raises(ValueError, match="cache_isolation"):
        GatewayConfig(cache_isolation="shared")


def test_per_key_cache_salts_separate_keys_and_client_salts():
    from gateway.tenants import ApiKeys, cache_salt

    keys = ApiKeys({"sk-a-0123456789": None, "sk-b-0123456789": None})
    a, b = keys.authenticate("Bearer sk-a-0123456789"), keys.authenticate("Bearer sk-b-0123456789")
    assert cache_salt(a, "x", "none") == "x" and cache_salt(a, None, "none") is None
    salts = {cache_salt(t, s, "per-key") for t in (a, b) for s in (None, "x", "y")}
    assert len(salts) == 6  # per key, and per client salt within a key
    assert cache_salt(a, "x", "per-key") == cache_salt(keys.authenticate("Bearer sk-a-0123456789"), "x", "per-key")
    assert all(len(s) <= 256 for s in salts)  # within the wire limit on cache_salt
    assert repr(a.key_digest) not in repr(a)  # the digest that keys the salts is never printed
