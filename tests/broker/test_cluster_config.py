"""`[broker] cluster_addresses`: Redis Cluster's seed nodes (gateway/config.py, docs/cluster.md §10). One of
`url`, `sentinel_addresses` and `cluster_addresses`; two at once is a config error naming both keys, and
`gateway check-config` exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_cluster_addresses_from_the_environment():
    config = load_config(environ={"GATEWAY_BROKER_CLUSTER_ADDRESSES": '["127.0.0.1:7000", "[::1]:7001"]'})
    assert config.broker.cluster_addresses == ["127.0.0.1:7000", "[::1]:7001"]
    assert config.broker.configured
    assert load_config(environ={}).broker.cluster_addresses == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "environ, message",
    [
        ({"GATEWAY_BROKER_CLUSTER_ADDRESSES": '["127.0.0.1"]'}, "broker.cluster_addresses: '127.0.0.1' is not"),
        (
            {"GATEWAY_BROKER_CLUSTER_ADDRESSES": '["127.0.0.1:7000"]', "GATEWAY_BROKER_URL": "redis://127.0.0.1:6379/0"},
            "broker.url and broker.cluster_addresses are both set",
        ),
        (
            {
                "GATEWAY_BROKER_CLUSTER_ADDRESSES": '["127.0.0.1:7000"]',
                "GATEWAY_BROKER_SENTINEL_MASTER": "m",
                "GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1:26379"]',
            },
            "broker.sentinel_addresses and broker.cluster_addresses are both set",
        ),
    ],
)
def test_bad_cluster_settings_are_refused(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_check_config_exits_2_naming_both_keys_when_sentinels_and_cluster_are_both_set():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(
        {
            "GATEWAY_BROKER_CLUSTER_ADDRESSES": '["127.0.0.1:7000"]',
            "GATEWAY_BROKER_SENTINEL_MASTER": "m",
            "GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1:26379"]',
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "broker.sentinel_addresses and broker.cluster_addresses are both set" in result.stderr
