"""A subscribe's `data` reaches the backend's subscribe hook (docs/integration.md): from our own `/ws`
subscribe command, and from a Centrifugo client's subscription `data` (centrifuge-python's
`new_subscription(..., data=)`); a subscribe without it sends none."""

from __future__ import annotations

import asyncio

from gateway.testing import run_gateway
from tests.gateway.gw_helpers import collect, send, ws_connect
from tests.gateway.hook_backend import Backend
from tests.gateway.test_centrifugo_client import PATH, client, run
from tests.gateway.test_proxy_hooks import proxy_config

RULES = {"rules": [{"pattern": "*", "kind": "ring", "anonymous": True, "proxy_subscribe": True}]}


def test_the_subscribe_hook_gets_the_subscribes_data(app: Backend):
    with run_gateway(proxy=proxy_config(app, connect_url=""), topics=RULES) as gw:
        with ws_connect(gw) as ws:
            send(ws, op="subscribe", topic="room.1", data={"invite": "x7"}, id=1)
            send(ws, op="subscribe", topic="room.2", id=2)
            collect(ws, lambda got: sum(e["type"] == "subscribed" for e in got) == 2)

        async def main() -> None:
            c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}")
            await c.connect()
            sub = c.new_subscription("room.3", data={"seat": 12})
            await sub.subscribe()
            for _ in range(50):
                if len(app.received["subscribe"]) == 3:
                    break
                await asyncio.sleep(0.05)
            await c.disconnect()

        run(main())
    bodies = {body["topic"]: body for body in app.received["subscribe"]}
    assert bodies["room.1"]["data"] == {"invite": "x7"}
    assert "data" not in bodies["room.2"]
    assert bodies["room.3"]["data"] == {"seat": 12} and bodies["room.3"]["transport"] == "centrifugo"
