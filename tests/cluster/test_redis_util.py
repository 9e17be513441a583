"""ensure_redis / RedisServer / RedisConfig: the start-up path `make up` and the tests rely on."""
from __future__ import annotations

import pytest

from common.cluster import redis_util
from common.cluster.redis_util import RedisConfig, RedisUnavailableError, connect, ensure_redis, ping, start_redis_server


def test_ensure_redis_uses_a_server_that_answers(redis_url):
    assert ensure_redis(redis_url) == (redis_url, None)


def test_ensure_redis_starts_a_private_server_when_nothing_answers_locally():
    with start_redis_server() as probe:
        dead_url = probe.url
        probe.kill()  # a local port where nothing answers
        url, server = ensure_redis(dead_url)
        try:
            assert server is not None and url == server.url and url != dead_url
            assert ping(url)
            assert server.dir and server.proc.poll() is None
        finally:
            server.stop()
        assert not ping(url)


def test_remote_address_that_does_not_answer_is_an_error(monkeypatch):
    monkeypatch.setattr(redis_util, "ping", lambda url, timeout_s=0.5: False)
    with pytest.raises(RedisUnavailableError, match="no Redis answers at redis://10.1.2.3:6379"):
        ensure_redis("redis://10.1.2.3:6379")


def test_missing_redis_server_binary_says_how_to_fix_it(monkeypatch):
    monkeypatch.setattr(redis_util.shutil, "which", lambda name: None)
    monkeypatch.setattr(redis_util, "ping", lambda url, timeout_s=0.5: False)
    with pytest.raises(RedisUnavailableError, match=r"apt-get install redis-server.*REDIS_URL"):
        ensure_redis("redis://127.0.0.1:1")


def test_config_from_env_and_validation():
    cfg = RedisConfig.from_env({"REDIS_URL": "redis://h:1/2", "PDSERVE_KEY_PREFIX": "prod-a",
                                "PDSERVE_HEARTBEAT_TTL_S": "3"})
    assert (cfg.url, cfg.key_prefix, cfg.heartbeat_ttl_s, cfg.timeout_s) == ("redis://h:1/2", "prod-a", 3.0, 1.0)
    assert RedisConfig.from_env({}).url == "redis://127.0.0.1:6379"
    with pytest.raises(ValueError, match="PDSERVE_HEARTBEAT_TTL_S='soon' is not a number"):
        RedisConfig.from_env({"PDSERVE_HEARTBEAT_TTL_S": "soon"})
    with pytest.raises(ValueError, match="scheme must be"):
        RedisConfig(url="http://h:1")
    with pytest.raises(ValueError, match="key_prefix"):
        RedisConfig(key_prefix="has space")
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        RedisConfig(heartbeat_ttl_s=0)


# ---- the password in REDIS_URL is never printed ------------------------------------------------------

PASSWORD = "s3cret-redis-pw-0123456789"


@pytest.mark.parametrize("url", [
    f"http://:{PASSWORD}@redis:6379/0",               # wrong scheme
    f"redis://:{PASSWORD}@redis:port/0",               # port not a number
    f"redis://:{PASSWORD}@[::1:6379/0",                # unclosed IPv6 bracket
    f"redis://:{PASSWORD}@/0",                         # no host
    f"redis://user:{PASSWORD}@/0",
    f"{PASSWORD}@redis:6379",                          # no scheme at all
    f"http://redis:6379/0?password={PASSWORD}",        # redis-py's query-string password
])
def test_a_malformed_redis_url_is_refused_without_its_password(url):
    for build in (lambda: RedisConfig(url=url), lambda: RedisConfig.from_env({"REDIS_URL": url}),
                  lambda: connect(url), lambda: ensure_redis(url)):
        try:
            build()
        except ValueError as exc:
            assert PASSWORD not in str(exc) and "REDIS_URL" in str(exc), str(exc)
        else:
            pytest.fail(f"{url} was accepted")


def test_an_unreachable_remote_redis_is_named_without_its_password(monkeypatch):
    monkeypatch.setattr(redis_util, "ping", lambda url, timeout_s=0.5: False)
    with pytest.raises(RedisUnavailableError, match=r"no Redis answers at redis://\*\*\*@10.1.2.3:6379") as err:
        ensure_redis(f"redis://:{PASSWORD}@10.1.2.3:6379")
    assert PASSWORD not in str(err.value)


def test_redis_config_repr_hides_the_password():
    config = RedisConfig(url=f"redis://user:{PASSWORD}@redis:6379/0")
    assert PASSWORD not in repr(config) and "redis://***@redis:6379/0" in repr(config)


def test_redact_and_with_password():
    from common.cluster.redis_util import redact_url, with_password

    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert redact_url(f"redis://:p@ss/{PASSWORD}@redis:6379/0") == "redis://***@redis:6379/0"  # unencoded '/', '@'
    assert redact_url(f"rediss://u:{PASSWORD}@h:1/2?db=3&password={PASSWORD}") == "rediss://***@h:1/2?db=3&password=***"
    assert with_password("redis://redis:6379/0", "p@ss/w:rd") == "redis://:p%40ss%2Fw%3Ard@redis:6379/0"
    assert with_password("redis://app@redis:6379/0", "pw") == "redis://app:pw@redis:6379/0"
    with pytest.raises(ValueError, match="already holds a password") as err:
        with_password(f"redis://:{PASSWORD}@redis:6379", "other")
    assert PASSWORD not in str(err.value)


def test_a_password_spliced_in_authenticates():
    """with_password's URL is one redis-py reads back exactly (a real server that requires it)."""
    import redis

    from common.cluster.redis_util import with_password

    password = "p@ss/w:rd#%20?x"
    with start_redis_server() as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("requirepass", password)
        client.close()
        assert ping(with_password(server.url, password))
        authed = redis.Redis.from_url(with_password(server.url, password))
        try:
            assert authed.ping()
        finally:
            authed.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(with_password(server.url, "wrong")).ping()
