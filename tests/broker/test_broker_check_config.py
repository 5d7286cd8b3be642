"""`gateway check-config` refuses two places for Redis at once: exit status 2, both keys named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_check_config_exits_2_naming_both_keys_when_url_and_sentinels_are_both_set():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(
        {
            "GATEWAY_BROKER_URL": "redis://127.0.0.1:6379/0",
            "GATEWAY_BROKER_SENTINEL_MASTER": "m",
            "GATEWAY_BROKER_SENTINEL_ADDRESSES": '["127.0.0.1:26379"]',
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "broker.url and broker.sentinel_addresses are both set" in result.stderr
