"""API keys as tenants: a client's cache_salt is bound to its key in both isolation modes (a salt
another key guesses shares nothing), and a key without its own limit gets the default one."""
from __future__ import annotations

import pytest

from common.engine.kv.prefix_hash import block_extra_keys, hash_prompt_blocks
from gateway.config import GatewayConfig
from gateway.tenants import ANONYMOUS, ApiKeys, cache_salt

KEY_A, KEY_B = "sk-tenant-a-7e3c9f01b2d4a658", "sk-tenant-b-0d6b2a9e4c1f7358"


def tenants():
    keys = ApiKeys({KEY_A: None, KEY_B: None})
    return keys.authenticate(f"Bearer {KEY_A}"), keys.authenticate(f"Bearer {KEY_B}")


def test_a_guessed_salt_shares_nothing_with_another_key_in_the_shared_mode():
    a, b = tenants()
    for isolation in ("none", "per-key"):
        served_a, served_b = cache_salt(a, "team", isolation), cache_salt(b, "team", isolation)
        assert served_a != served_b and "team" not in (served_a, served_b)
        assert served_a == cache_salt(a, "team", isolation)  # one key's requests with its salt still share
        prompt = list(range(64))
        assert (hash_prompt_blocks(prompt, 16, block_extra_keys("m", served_a))
                != hash_prompt_blocks(prompt, 16, block_extra_keys("m", served_b)))
    # Unsalted requests are what the shared mode shares; without API keys the salt is the client's.
    assert cache_salt(a, None, "none") is None and cache_salt(b, None, "none") is None
    assert cache_salt(ANONYMOUS, "team", "none") == "team"


def test_a_key_without_its_own_limit_gets_half_of_max_inflight_when_keys_share_the_gateway(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}:3\n{KEY_B}\n")
    limits = sorted(t.limit or 0 for t in tenants_of(GatewayConfig(api_keys_file=str(keys), max_inflight=40)))
    assert limits == [3, 20]
    unlimited = GatewayConfig(api_keys_file=str(keys), max_inflight=40, max_inflight_per_key=0)
    assert sorted(t.limit or 0 for t in tenants_of(unlimited)) == [0, 3]
    alone = GatewayConfig(api_key=KEY_A, max_inflight=40).api_keys().authenticate(f"Bearer {KEY_A}")
    assert alone.limit is None  # a single key may use every slot


def tenants_of(config: GatewayConfig):
    keys = config.api_keys()
    return [keys.authenticate(f"Bearer {k}") for k in (KEY_A, KEY_B)]


def test_the_keys_checked_are_the_keys_served_and_the_file_is_read_once(tmp_path, monkeypatch):
    """The API keys file is read once per configuration: a key added to it after the strength
    check (a weak one, here) is not served by a gateway started from that configuration."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")
    reads = []
    read_text = type(keys).read_text

    def counting(path, *args, **kwargs):
        if path == keys:
            reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(type(keys), "read_text", counting)
    config = GatewayConfig(api_keys_file=str(keys), host="0.0.0.0", cluster_secret="c" * 32)
    keys.write_text(f"{KEY_A}\nweak\n")
    served = config.api_keys()
    assert served.authenticate(f"Bearer {KEY_A}") is not None and served.authenticate("Bearer weak") is None
    assert config.open_to_the_network is False and len(reads) == 1


def test_a_key_gets_half_of_the_wait_queue_when_keys_share_the_gateway(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}:3\n{KEY_B}\n")
    queue = GatewayConfig(api_keys_file=str(keys), queue_size=100, queue_timeout=4.0).wait_queue()
    assert (queue.size, queue.timeout_s, queue.per_key) == (100, 4.0, 50)
    assert GatewayConfig(api_keys_file=str(keys), queue_size=100, queue_size_per_key=7).wait_queue().per_key == 7
    assert GatewayConfig(api_keys_file=str(keys), queue_size_per_key=0).wait_queue().per_key is None
    assert GatewayConfig(api_key=KEY_A).wait_queue().per_key is None  # a single key may fill the line
    assert GatewayConfig().wait_queue().per_key is None  # no keys: one tenant


def test_two_keys_that_would_share_a_key_id_are_refused(monkeypatch):
    from gateway import tenants

    tenants.ApiKeys({"sk-one-0123456789abcdef": None, "sk-two-0123456789abcdef": None})  # distinct ids: served
    monkeypatch.setattr(tenants, "key_id", lambda key: "key-000000000000")  # as a 48-bit collision would be
    with pytest.raises(ValueError, match="share a key id"):
        tenants.ApiKeys({"sk-one-0123456789abcdef": None, "sk-two-0123456789abcdef": None})
