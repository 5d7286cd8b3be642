"""A gateway without any hook URL (its hub holds `NoHooks`, gateway/hooks/base.py) serves subscribe, publish and
the builtin rpc methods at once, over a real WebSocket."""

from __future__ import annotations

from gateway.hooks.base import NoHooks
from gateway.testing import run_gateway
from tests.gateway.gw_helpers import collect, send, ws_connect

RULES = [{"pattern": "*", "kind": "ring", "anonymous": True, "client_publish": True}]


def test_without_hooks_subscribe_publish_and_rpc_are_served_at_once() -> None:
    with run_gateway(topics={"rules": RULES}) as gw:
        assert isinstance(gw.hub.hooks, NoHooks)
        with ws_connect(gw) as ws:
            send(ws, op="subscribe", topic="news", id=1)
            send(ws, op="publish", topic="news", data={"n": 1}, id=2)
            send(ws, op="rpc", method="echo", params={"x": 1}, id=3)
            got = collect(
                ws, lambda entries: any(e.get("data") == {"n": 1} for e in entries) and any(e.get("id") == 3 for e in entries)
            )
        assert not [e for e in got if "error" in e]
        assert {"x": 1} in [e.get("result") for e in got if e.get("id") == 3]
