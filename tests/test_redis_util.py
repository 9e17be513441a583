"""ensure_redis / RedisServer / RedisConfig: the start-up path `make up` and the tests rely on."""
from __future__ import annotations

import pytest

from common.cluster import redis_util
from common.cluster.redis_util import RedisConfig, RedisUnavailableError, ensure_redis, ping, start_redis_server


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
