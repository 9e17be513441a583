"""The gateway's flags: every one also reads PDSERVE_<FLAG>; old variable names stay aliases.
Secrets: read from the environment or a file, never printed (--help, reprs, logs), strong and
distinct; a gateway other machines can reach needs an API key unless the operator opts out."""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from common.cluster.auth import SECRET_ENV, generate_secret
from common.cluster.http_limits import DEFAULTS, HttpLimits
from launcher.local_stack import ROOT
from gateway.config import GatewayConfig, build_parser, config_from_args, env_names
from gateway.tenants import key_id

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
        switch = isinstance(a, argparse._StoreTrueAction)
        env[f"PDSERVE_{a.dest.upper()}"] = "true" if switch else CHOICES.get(a.dest, SAMPLE[kind])
    args = build_parser(env).parse_args([])
    for a in actions:
        raw = env[f"PDSERVE_{a.dest.upper()}"]
        expected = a.type(raw) if a.type in (int, float) else True if raw == "true" else raw
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
    for ttl in ("0", "nan", str(400 * 86400)):
        with pytest.raises(ValueError, match="conversations_ttl"):
            config_from_args(build_parser({}).parse_args(["--conversations-ttl", ttl]))
    assert config_from_args(build_parser({}).parse_args(["--conversations-ttl", "60"])).conversations_ttl == 60


def test_cache_isolation_per_key_needs_api_keys():
    env = {"PDSERVE_CACHE_ISOLATION": "per-key"}
    with pytest.raises(ValueError, match="cache_isolation per-key needs API keys"):
        config_from_args(build_parser(env).parse_args([]))
    config = config_from_args(build_parser({**env, "PDSERVE_API_KEY": "sk-0123456789abcdef"}).parse_args([]))
    assert config.cache_isolation == "per-key"
    assert config_from_args(build_parser({}).parse_args([])).cache_isolation == "none"
    with pytest.raises(ValueError, match="cache_isolation"):
        GatewayConfig(cache_isolation="shared")


def test_per_key_cache_salts_separate_keys_and_client_salts():
    from gateway.tenants import ApiKeys, cache_salt

    keys = ApiKeys({"sk-a-0123456789": None, "sk-b-0123456789": None})
    a, b = keys.authenticate("Bearer sk-a-0123456789"), keys.authenticate("Bearer sk-b-0123456789")
    assert cache_salt(a, "x", "none") == cache_salt(a, "x", "per-key") != "x" and cache_salt(a, None, "none") is None
    salts = {cache_salt(t, s, "per-key") for t in (a, b) for s in (None, "x", "y")}
    assert len(salts) == 6  # per key, and per client salt within a key
    assert cache_salt(a, "x", "per-key") == cache_salt(keys.authenticate("Bearer sk-a-0123456789"), "x", "per-key")
    assert all(len(s) <= 256 for s in salts)  # within the wire limit on cache_salt
    assert repr(a.key_digest) not in repr(a)  # the digest that keys the salts is never printed


# ---- secrets -------------------------------------------------------------------------------------

API_KEY, ADMIN_TOKEN, CLUSTER_SECRET = "sk-" + generate_secret(), generate_secret(), generate_secret()
REDIS_PASSWORD = "redis-pw-" + generate_secret()
SECRETS_ENV = {"PDSERVE_API_KEY": API_KEY, "PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN,
               "REDIS_URL": f"redis://:{REDIS_PASSWORD}@redis.internal:6379/0"}


def parse(argv=(), env=None, environ=None):
    """The gateway's configuration from ``argv`` and ``env`` (its flags' variables), ``environ``
    standing in for the process environment (the cluster secret)."""
    return config_from_args(build_parser(env or {}).parse_args(list(argv)), environ or {})


def test_help_never_shows_a_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # no line breaks inside a value (textwrap breaks at hyphens)
    text = build_parser(SECRETS_ENV).format_help()
    for secret in (API_KEY, ADMIN_TOKEN, REDIS_PASSWORD):
        assert secret not in text
    assert "redis://***@redis.internal:6379/0" in text  # where Redis is stays visible
    assert "PDSERVE_ADMIN_TOKEN or the file --admin-token-file; never shown" in text


def test_config_repr_hides_every_secret():
    config = parse(env=SECRETS_ENV, environ={SECRET_ENV: CLUSTER_SECRET})
    assert (config.api_key, config.admin_token, config.cluster_secret) == (API_KEY, ADMIN_TOKEN, CLUSTER_SECRET)
    for secret in (API_KEY, ADMIN_TOKEN, CLUSTER_SECRET, REDIS_PASSWORD):
        assert secret not in repr(config) and secret not in str(config)


def test_every_secret_reads_from_a_file(tmp_path):
    files = {"admin": (tmp_path / "admin", ADMIN_TOKEN), "redis": (tmp_path / "redis", "p@ss/w:rd#" + REDIS_PASSWORD),
             "keys": (tmp_path / "keys", API_KEY), "cluster": (tmp_path / "cluster", CLUSTER_SECRET)}
    for path, value in files.values():
        path.write_text(value + "\n")  # files end with a newline; it is not part of the secret
    env = {"PDSERVE_ADMIN_TOKEN_FILE": str(files["admin"][0]), "PDSERVE_REDIS_PASSWORD_FILE": str(files["redis"][0]),
           "PDSERVE_API_KEYS_FILE": str(files["keys"][0]), "PDSERVE_CLUSTER_SECRET_FILE": str(files["cluster"][0]),
           "REDIS_URL": "redis://redis.internal:6379/0"}
    config = parse(env=env)
    assert config.admin_token == ADMIN_TOKEN and config.auth().enabled and config.api_keys().enabled
    from redis.connection import parse_url

    assert parse_url(config.redis_url)["password"] == files["redis"][1]  # spliced in, percent-encoded
    # The flags name files too; a file beats the variable that holds the value itself.
    flagged = parse(["--admin-token-file", str(files["admin"][0])], env={"PDSERVE_ADMIN_TOKEN": generate_secret()})
    assert flagged.admin_token == ADMIN_TOKEN
    # An empty file is an empty secret (refused), a missing one an error naming the file only.
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="admin token.*it is empty"):
        parse(env={"PDSERVE_ADMIN_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="cannot read the admin token from the file .*missing"):
        parse(env={"PDSERVE_ADMIN_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="already holds a password") as err:
        parse(env={**env, "REDIS_URL": f"redis://:{REDIS_PASSWORD}@redis.internal:6379/0"})
    assert REDIS_PASSWORD not in str(err.value)


@pytest.mark.parametrize("flag, dest", [("--admin-token", "admin_token"), ("--api-key", "api_key")])
def test_a_secret_on_the_command_line_works_with_a_warning_naming_the_flag(flag, dest, caplog):
    value = generate_secret()
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        config = parse([flag, value])
    assert getattr(config, dest) == value
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(flag in w and "command line" in w for w in warnings), warnings
    assert not any(value in w for w in warnings)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        parse(env={f"PDSERVE_{dest.upper()}": value})  # from the environment: nothing to warn about
    assert not caplog.records


def test_a_redis_password_on_the_command_line_is_warned_about(caplog):
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0"
    with caplog.at_level(logging.WARNING):
        assert parse(["--redis-url", url]).redis_url == url
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "--redis-url" in messages and REDIS_PASSWORD not in messages


@pytest.mark.parametrize("settings, problem", [
    ({"admin_token": "admin-secret"}, "admin token .* shorter than 16"),
    ({"admin_token": "change-me-admin-token-please"}, "admin token .* placeholder"),
    ({"api_key": "test-key"}, f"API key {key_id('test-key')} .* shorter than 16"),
    ({"api_key": ""}, "it is empty"),
])
def test_weak_admin_tokens_and_api_keys_are_refused(settings, problem):
    with pytest.raises(ValueError, match=problem) as err:
        GatewayConfig(**settings)
    assert not any(v and v in str(err.value) for v in settings.values())


def test_weak_keys_in_the_api_keys_file_are_refused_by_id(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{API_KEY}:4\nsk-short:2\n")
    with pytest.raises(ValueError, match=f"API key {key_id('sk-short')} is not acceptable") as err:
        GatewayConfig(api_keys_file=str(keys))
    assert "sk-short" not in str(err.value).replace(key_id("sk-short"), "")


@pytest.mark.parametrize("settings, pair", [
    ({"admin_token": CLUSTER_SECRET, "cluster_secret": CLUSTER_SECRET}, "the cluster secret and the admin token"),
    ({"api_key": ADMIN_TOKEN, "admin_token": ADMIN_TOKEN}, f"the admin token and API key {key_id(ADMIN_TOKEN)}"),
    ({"api_key": CLUSTER_SECRET, "cluster_secret": CLUSTER_SECRET}, "the cluster secret and API key"),
], ids=["admin-token-is-cluster-secret", "api-key-is-admin-token", "api-key-is-cluster-secret"])  # no random ids
def test_secrets_must_be_distinct(settings, pair):
    with pytest.raises(ValueError, match=f"{pair}.* are the same value"):
        GatewayConfig(**settings)


def test_a_gateway_other_machines_reach_needs_an_api_key_or_the_opt_out(caplog):
    with pytest.raises(ValueError, match="requires no API key.*PDSERVE_ALLOW_NO_API_KEY=1"):
        GatewayConfig(host="0.0.0.0", cluster_secret=CLUSTER_SECRET)
    assert GatewayConfig(host="0.0.0.0", cluster_secret=CLUSTER_SECRET, api_key=API_KEY).api_keys().enabled
    assert not GatewayConfig(host="127.0.0.1").open_to_the_network  # a laptop needs no key
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        config = parse(["--host", "0.0.0.0"], env={"PDSERVE_ALLOW_NO_API_KEY": "1"},
                       environ={SECRET_ENV: CLUSTER_SECRET})
    assert config.allow_no_api_key and config.open_to_the_network
    assert any("without an API key" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_gateway_process_refuses_to_serve_other_machines_without_an_api_key():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), SECRET_ENV: CLUSTER_SECRET}
    result = subprocess.run([sys.executable, "-m", "gateway", "--host", "0.0.0.0", "--port", "0"], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode != 0
    assert "requires no API key" in result.stderr and "PDSERVE_ALLOW_NO_API_KEY=1" in result.stderr


def test_a_bad_environment_value_is_an_error_line_naming_it_not_a_traceback():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PDSERVE_ALLOW_NO_API_KEY": "maybe"}
    result = subprocess.run([sys.executable, "-m", "gateway"], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: PDSERVE_ALLOW_NO_API_KEY='maybe'"), result.stderr


def test_a_role_body_nested_too_deep_is_a_400_naming_role():
    from gateway.openai_errors import OpenAIError
    from gateway.server import _check_role_body

    with pytest.raises(OpenAIError) as refused:
        _check_role_body(b"[" * 100_000 + b"]" * 100_000)
    assert refused.value.status == 400 and refused.value.param == "role"


def test_the_gateways_flags_are_its_listeners_limits():
    """The gateway's port limits default to ``HttpLimits``' (declared there once), and each flag
    reaches its listener -- ``--client-write-timeout`` is its write deadline."""
    def limits(*argv: str) -> HttpLimits:
        return config_from_args(build_parser({}).parse_args(list(argv)), {}).http_limits()

    assert limits() == DEFAULTS
    assert limits("--max-connections", "9", "--header-timeout", "1", "--keepalive-timeout", "2",
                  "--client-read-timeout", "3", "--client-write-timeout", "4") == HttpLimits(9, 1.0, 2.0, 3.0, 4.0)
