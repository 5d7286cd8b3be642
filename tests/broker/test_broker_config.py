"""The `[broker]` keys that say where Redis is: `url`, or `sentinel_addresses` with `sentinel_master`
(gateway/config.py, docs/cluster.md "Topologies"). Exactly one; both is a config error naming both keys."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def test_sentinel_keys_from_the_environment():
    config = load_config(
        environ={
            "GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1:26379", "[::1]:26380"]',
            "GATEWAY_BROKER_SENTINEL_MASTER": "mymaster",
        }
    )
    assert config.broker.sentinel_addresses == ["127.0.0.1:26379", "[::1]:26380"]
    assert config.broker.sentinel_master == "mymaster" and config.broker.configured
    assert not load_config(environ={}).broker.configured


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1:26379"]'}, "needs broker.sentinel_master"),
        (
            {"GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1"]', "GATEWAY_BROKER_SENTINEL_MASTER": "m"},
            "'127.0.0.1' is not \"host:port\"",
        ),
        (
            {"GATEWAY_BROKER_SENTINEL_ADDRESSES": '["h:99999"]', "GATEWAY_BROKER_SENTINEL_MASTER": "m"},
            "'h:99999' is not \"host:port\"",
        ),
    ],
)
def test_bad_sentinel_settings_are_refused(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_url_and_sentinels_at_once_name_both_keys():
    with pytest.raises(ConfigError, match="broker.url and broker.sentinel_addresses are both set"):
        load_config(
            environ={
                "GATEWAY_BROKER_URL": "redis://127.0.0.1:6379/0",
                "GATEWAY_BROKER_SENTINEL_MASTER": "m",
                "GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1:26379"]',
            }
        )
