"""Centrifugo's client protocol (docs/centrifugo.md, "Client protocol") with the real SDKs: the connect hook's
server-side subscriptions in the connect result's `subs`, recovered on reconnect from the position the SDK
sends in `connect` `subs` (exactly the missed publications, once each, in order; past the ring
`recovered: false` and no duplicate), with centrifuge-python and centrifuge-js under Node; and join/leave
pushes only for a subscription whose `subscribe` asked for them (`join_leave`), /ws clients unchanged."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from centrifuge import (  # type: ignore[import-untyped]  # it ships no type information
    ServerPublicationContext,
    ServerSubscribedContext,
    ServerUnsubscribedContext,
)

from gateway.testing import make_token, run_gateway
from tests.gateway.gw_helpers import collect, send, ws_connect
from tests.gateway.hook_backend import Backend
from tests.gateway.test_centrifugo_client import PATH, Events, Proxy, SubEvents, client, fresh, publish, raw, run, until
from tests.gateway.test_proxy_hooks import proxy_config

#: a ring of 8; a cycle budget that holds a few publications: a recovery's first ones go in the connect
#: result, the rest follow as pushes
RULES = {
    "rules": [
        {"pattern": "srv.*", "kind": "ring", "capacity": 8, "anonymous": True},
        {"pattern": "room.*", "kind": "ring", "capacity": 64, "anonymous": True, "presence": True, "join_leave": True},
        {"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True},
    ]
}
SCHEDULER = {"cycle_budget_bytes": 300}
PAD = "x" * 100
JS = Path(__file__).resolve().parents[1] / "centrifugo_js"


@pytest.fixture(scope="module")
def gw(backend: Backend) -> Iterator[Any]:
    """One gateway on the module's backend (the `app` of each test answers its hooks): each test on a channel
    of its own."""
    with run_gateway(proxy=proxy_config(backend), topics=RULES, scheduler=SCHEDULER) as handle:
        yield handle


class ServerEvents(Events):
    """The client's events of its server-side subscriptions."""

    def __init__(self) -> None:
        super().__init__()
        self.subscribed: list[ServerSubscribedContext] = []
        self.unsubscribed: list[ServerUnsubscribedContext] = []
        self.publications: list[tuple[str, int, Any]] = []

    async def on_subscribed(self, ctx: ServerSubscribedContext) -> None:
        self.subscribed.append(ctx)

    async def on_unsubscribed(self, ctx: ServerUnsubscribedContext) -> None:
        self.unsubscribed.append(ctx)

    async def on_publication(self, ctx: ServerPublicationContext) -> None:
        self.publications.append((ctx.channel, ctx.pub.offset, ctx.pub.data))


def test_server_side_subscriptions_recover_on_reconnect_python(gw, app: Backend):
    channel = fresh("srv")
    app.answers["connect"] = {"user": "alice", "topics": [channel]}

    async def main() -> None:
        proxy = Proxy(gw.http_port)
        port = await proxy.start()
        events = ServerEvents()
        c = client(f"ws://127.0.0.1:{port}{PATH}", events)
        await c.connect()
        await until(lambda: events.subscribed, "subscribed server-side")
        first = events.subscribed[0]
        assert first.channel == channel and first.recoverable and first.positioned
        assert not first.was_recovering and not first.recovered
        for n in range(2):
            await asyncio.to_thread(publish, gw, channel, n)
        await until(lambda: len(events.publications) == 2, "2 publications")

        proxy.cut()  # missed: 2..6, all in the ring; a few go in the connect result, the rest as pushes
        await until(lambda: len(events.connecting) >= 2, "reconnecting")
        for n in range(2, 7):
            await asyncio.to_thread(publish, gw, channel, n)
        proxy.restore()
        await until(lambda: len(events.subscribed) == 2, "subscribed again")
        assert events.subscribed[1].recovered and events.subscribed[1].was_recovering
        await until(lambda: len(events.publications) == 7, "the missed publications")
        await asyncio.sleep(0.3)
        assert events.publications == [(channel, n + 1, n) for n in range(7)]

        proxy.cut()  # missed: 12 publications, the ring holds 8
        await until(lambda: len(events.connecting) >= 3, "reconnecting")
        for n in range(7, 19):
            await asyncio.to_thread(publish, gw, channel, n)
        proxy.restore()
        await until(lambda: len(events.subscribed) == 3, "subscribed a third time")
        assert not events.subscribed[2].recovered and events.subscribed[2].was_recovering
        await asyncio.to_thread(publish, gw, channel, 19)
        await until(lambda: len(events.publications) == 8, "a live publication")
        await asyncio.sleep(0.3)
        assert events.publications[7:] == [(channel, 20, 19)]  # none of the unrecoverable ones, no duplicate
        assert events.unsubscribed == []  # the subscription went on through every reconnect
        await c.disconnect()
        await proxy.stop()

    run(main())


def test_the_connect_result_carries_the_server_side_subscription(gw, app: Backend):
    channel = fresh("srv")
    app.answers["connect"] = {"user": "alice", "topics": [channel]}
    for n in range(5):
        publish(gw, channel, [n, PAD])
    with raw(gw) as ws:
        ws.send(json.dumps({"id": 1, "connect": {}}))
        reply = json.loads(ws.recv(timeout=5).split("\n")[0])
    sub = reply["connect"]["subs"][channel]
    epoch = sub["epoch"]
    assert sub == {"recoverable": True, "positioned": True, "epoch": epoch, "offset": 5}
    with raw(gw) as ws:  # from offset 2: 3, 4, 5 missed; what fits in the result, then pushes
        ws.send(json.dumps({"id": 1, "connect": {"subs": {channel: {"recover": True, "offset": 2, "epoch": epoch}}}}))
        got = [json.loads(line) for line in ws.recv(timeout=5).split("\n")]
        sub = got[0]["connect"]["subs"][channel]
        inline = [(p["offset"], p["data"]) for p in sub.pop("publications")]
        assert sub == {
            "recoverable": True,
            "positioned": True,
            "epoch": epoch,
            "offset": 2,
            "was_recovering": True,
            "recovered": True,
        }
        pushed = [(m["push"]["pub"]["offset"], m["push"]["pub"]["data"]) for m in got[1:]]
        while len(inline) + len(pushed) < 3:
            pushed += [
                (m["push"]["pub"]["offset"], m["push"]["pub"]["data"]) for m in map(json.loads, ws.recv(timeout=5).split("\n"))
            ]
        assert inline and pushed and inline + pushed == [(3, [2, PAD]), (4, [3, PAD]), (5, [4, PAD])]
    with raw(gw) as ws:  # another epoch: not recovered, none, from the end
        ws.send(json.dumps({"id": 1, "connect": {"subs": {channel: {"recover": True, "offset": 2, "epoch": "other"}}}}))
        sub = json.loads(ws.recv(timeout=5).split("\n")[0])["connect"]["subs"][channel]
        assert sub == {"recoverable": True, "positioned": True, "epoch": epoch, "offset": 5, "was_recovering": True}
        publish(gw, channel, 5)
        assert json.loads(ws.recv(timeout=5)) == {"push": {"channel": channel, "pub": {"data": 5, "offset": 6}}}


def test_a_bad_subs_is_a_bad_request(app: Backend):
    app.answers["connect"] = {"user": "alice", "topics": ["srv.x"]}
    with run_gateway(proxy=proxy_config(app), topics=RULES) as gw, raw(gw) as ws:
        ws.send(json.dumps({"id": 1, "connect": {"subs": {"srv.x": {"recover": True, "offset": "2"}}}}))
        with pytest.raises(Exception) as closed:
            while True:
                ws.recv(timeout=5)
        assert closed.value.rcvd.code == 3501  # type: ignore[attr-defined]


@pytest.mark.skipif(
    shutil.which("node") is None or not (JS / "node_modules" / "centrifuge").is_dir(),
    reason="node and tests/centrifugo_js/node_modules (make test installs them)",
)
@pytest.mark.parametrize("mode", ["json", "protobuf"])
def test_server_side_subscriptions_recover_on_reconnect_js(gw, app: Backend, mode: str):
    channel = fresh("srv")
    app.answers["connect"] = {"user": "alice", "topics": [channel]}
    done = subprocess.run(
        ["node", "server_subs.js", gw.http_url, gw.admin_token, channel, mode],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["subscribed"] == [
        {"recovered": False, "wasRecovering": False},
        {"recovered": True, "wasRecovering": True},
        {"recovered": False, "wasRecovering": True},
    ]
    assert seen["publications"] == [[n + 1, n] for n in range(7)] + [[20, 19]]
    assert seen["unsubscribed"] == 0


# -- join/leave ------------------------------------------------------------------------------------------------


def test_join_leave_only_for_the_subscriptions_that_asked():
    channel = fresh("room")
    with run_gateway(topics=RULES) as gw:

        async def main() -> None:
            url = f"ws://127.0.0.1:{gw.http_port}{PATH}"
            asking, silent, third = client(url, token=make_token("ann")), client(url), client(url)
            asking_events, silent_events, third_events = SubEvents(), SubEvents(), SubEvents()
            asking_sub = asking.new_subscription(channel, asking_events, join_leave=True)
            silent_sub = silent.new_subscription(channel, silent_events)
            third_sub = third.new_subscription(channel, third_events)
            with ws_connect(gw, query=f"?token={make_token('wes')}") as ws:
                send(ws, op="subscribe", topic=channel, id=1)
                await asyncio.to_thread(collect, ws, lambda got: any(e["type"] == "subscribed" for e in got))
                for c, sub, events in ((asking, asking_sub, asking_events), (silent, silent_sub, silent_events)):
                    await c.connect()
                    await sub.subscribe()
                    await until(partial(getattr, events, "subscribed"), "subscribed")
                await third.connect()
                await third_sub.subscribe()
                await until(lambda: third_events.subscribed, "the third subscribed")
                third_id = (await third.rpc("whoami", None)).data["client_id"]
                # a join and a leave within one flush cancel out: the leave comes once the join was sent
                await until(lambda: third_id in asking_events.joins, "join")
                await third_sub.unsubscribe()
                await until(lambda: asking_events.leaves, "leave")
                ws_seen = await asyncio.to_thread(
                    collect, ws, lambda got: any(e["type"] == "leave" and e.get("client") == third_id for e in got)
                )
                await asyncio.sleep(0.3)  # what the silent one would get meanwhile
                assert asking_events.joins[-1:] == [third_id] and asking_events.leaves == [third_id]
                assert silent_events.joins == [] and silent_events.leaves == []
                assert [e["type"] for e in ws_seen if e.get("client") == third_id] == ["join", "leave"]
            for c in (asking, silent, third):
                await c.disconnect()

        run(main())
