"""Centrifugo's client protocol at /connection/websocket with the real centrifuge-js SDK under Node (its JSON
build; the Protobuf one in test_centrifugo_protobuf.py): tests/centrifugo_js/scenario.js runs a scenario and
prints what the SDK saw. The SDK and `ws` are pinned in tests/centrifugo_js/package.json (`make test`
installs them)."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.testing import make_token, run_gateway

JS = Path(__file__).resolve().parents[1] / "centrifugo_js"
RULES = {
    "rules": [
        {"pattern": "hist.*", "kind": "ring", "capacity": 8, "anonymous": True},
        {"pattern": "locked.*", "kind": "ring", "capacity": 64},
        {"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True, "client_publish": True, "presence": True},
    ]
}

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS / "node_modules" / "centrifuge").is_dir(),
    reason="node and tests/centrifugo_js/node_modules (make test installs them)",
)

_names = itertools.count()


@pytest.fixture(scope="module")
def gw():
    with run_gateway(topics=RULES) as gateway:
        yield gateway


def scenario(gw, name: str, channel: str, token: str = "", *extra: str) -> Any:
    done = subprocess.run(
        ["node", "scenario.js", name, gw.http_url, gw.admin_token, token, channel, *extra],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def basic(gw, *extra: str) -> None:
    channel = f"js.{next(_names)}"
    seen = scenario(gw, "basic", channel, make_token("jo"), *extra)
    assert seen["offsets"] == [1, 2, 3]  # seq + 1
    assert seen["publications"] == [[1, {"n": 0}], [2, {"n": 1}], [3, {"n": 2}], [4, {"n": "mine"}]]
    assert seen["lockedUnsubscribed"] == [103] and seen["denied"] == 103
    assert seen["rpc"] == {"a": 1}
    assert seen["history"] == seen["publications"] and seen["historyOffset"] == 4
    assert seen["presence"] == 1


def test_connect_subscribe_publish_history_presence_rpc(gw):
    basic(gw)


def test_a_bad_token_ends_without_a_reconnect_loop(gw):
    seen = scenario(gw, "badToken", "js.bad", make_token("jo", secret="not-the-secret-of-the-gateway-0000"))
    assert seen["disconnected"] == [3500] and seen["connecting"] == 1 and seen["connected"] == 0


def test_recovery_after_a_transport_drop_and_past_the_ring(gw):
    seen = scenario(gw, "recovery", f"hist.js{next(_names)}")
    assert seen["subscribed"] == [
        {"recovered": False, "wasRecovering": False},
        {"recovered": True, "wasRecovering": True},
        {"recovered": False, "wasRecovering": True},
    ]
    # exactly the missed ones once each after the drop; past the ring none of them, and the live one
    assert seen["publications"] == [[n + 1, n] for n in range(5)] + [[18, 17]]
