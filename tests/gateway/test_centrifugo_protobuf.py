"""Centrifugo's client protocol in Protobuf at /connection/websocket (docs/centrifugo.md, "Client protocol"):
centrifuge-python with `use_protobuf=True` and centrifuge-js's Protobuf build against a real gateway, the
same scenarios as in JSON (test_centrifugo_client.py, test_centrifugo_js.py); data is JSON text in bytes."""

from __future__ import annotations

import asyncio
import json

import pytest
from centrifuge.exceptions import ReplyError  # type: ignore[import-untyped]
from websockets.sync.client import connect

from gateway.testing import make_token, run_gateway
from tests.gateway import test_centrifugo_js as js
from tests.gateway.test_centrifugo_client import (
    PATH,
    Events,
    Proxy,
    SubEvents,
    client,
    closed_with,
    fresh,
    publish,
    run,
    until,
)

RULES = {
    "rules": [
        {"pattern": "hist.*", "kind": "ring", "capacity": 8, "anonymous": True},
        {"pattern": "locked.*", "kind": "ring", "capacity": 64},
        {"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True, "client_publish": True, "presence": True},
    ]
}


@pytest.fixture(scope="module")
def gw():
    with run_gateway(topics=RULES, centrifugo={"ping_interval_s": 1.0, "pong_timeout_s": 2.0}) as gateway:
        yield gateway


def test_python_sdk_in_protobuf(gw):
    channel = fresh("pb")

    async def main() -> None:
        c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}", token=make_token("pat"), use_protobuf=True)
        events = SubEvents()
        sub = c.new_subscription(channel, events, recoverable=True)
        await c.connect()
        await sub.subscribe()
        await until(lambda: events.subscribed, "subscribed")
        offsets = [await asyncio.to_thread(publish, gw, channel, {"n": n}) for n in range(3)]
        await c.publish(channel, b'{"n":"mine"}')
        await until(lambda: len(events.publications) == 4, "publications")
        assert [(offset, json.loads(data)) for offset, data in events.publications] == [
            (1, {"n": 0}),
            (2, {"n": 1}),
            (3, {"n": 2}),
            (4, {"n": "mine"}),
        ]
        assert offsets == [1, 2, 3]
        assert json.loads((await c.rpc("echo", b'{"a":1}')).data) == {"a": 1}
        history = await c.history(channel, limit=-1)
        assert [p.offset for p in history.publications] == [1, 2, 3, 4] and history.offset == 4
        assert json.loads(history.publications[0].data) == {"n": 0}
        presence = await c.presence(channel)
        assert [info.user for info in presence.clients.values()] == ["pat"]
        stats = await c.presence_stats(channel)
        assert (stats.num_clients, stats.num_users) == (1, 1)
        with pytest.raises(ReplyError) as refusal:
            await c.publish(f"locked.{channel}", b"1")
        assert refusal.value.code == 103
        with pytest.raises(ReplyError) as bad:
            await c.publish(channel, b"not json")
        assert bad.value.code == 107
        await c.disconnect()

    run(main())


def test_python_sdk_in_protobuf_recovers_and_is_pinged(gw):
    channel = fresh("hist")

    async def main() -> None:
        proxy = Proxy(gw.http_port)
        port = await proxy.start()
        events, sub_events = Events(), SubEvents()
        c = client(f"ws://127.0.0.1:{port}{PATH}", events, use_protobuf=True, max_server_ping_delay=0.5)
        sub = c.new_subscription(channel, sub_events, recoverable=True)
        await c.connect()
        await sub.subscribe()
        await until(lambda: sub_events.subscribed, "subscribed")
        await asyncio.to_thread(publish, gw, channel, 0)
        await until(lambda: sub_events.publications, "a publication")
        await asyncio.sleep(2.5)  # pings, every second: no reconnect
        assert len(events.connecting) == 1
        proxy.cut()
        await until(lambda: len(events.connecting) == 2, "reconnecting")
        for n in range(1, 4):
            await asyncio.to_thread(publish, gw, channel, n)
        proxy.restore()
        await until(lambda: len(sub_events.subscribed) == 2 and len(sub_events.publications) == 4, "recovered")
        await asyncio.sleep(0.3)
        assert sub_events.subscribed[1].recovered
        assert [(offset, json.loads(data)) for offset, data in sub_events.publications] == [(n + 1, n) for n in range(4)]
        await c.disconnect()
        await proxy.stop()

    run(main())


def test_protobuf_asked_in_the_query_and_bad_frames():
    with run_gateway(topics=RULES) as gw:
        with connect(f"ws://127.0.0.1:{gw.http_port}{PATH}?cf_protocol=protobuf", open_timeout=5, compression=None) as ws:
            ws.send(b"\x04\x08\x01\x22\x00")  # Command{id: 1, connect: {}}
            reply = ws.recv(timeout=5)
            assert isinstance(reply, bytes) and reply[1:4] == b"\x08\x01\x2a"  # Reply{id: 1, connect: ...}
            ws.send(b"\x05\x08")  # a length past the frame's end
            assert closed_with(ws) == 3501


@pytest.mark.skipif(js.pytestmark.args[0], reason=js.pytestmark.kwargs["reason"])
def test_js_sdk_in_protobuf(gw):
    js.basic(gw, "--protobuf")
