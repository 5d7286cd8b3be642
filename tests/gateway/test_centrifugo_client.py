"""Centrifugo's client protocol at /connection/websocket (docs/centrifugo.md, "Client protocol") with the real
centrifuge-python SDK (JSON; Protobuf in test_centrifugo_protobuf.py) against a real gateway: connect with a
token and anonymously, bad and expired tokens ending without a reconnect loop, publications from the server
API in order with offset = seq + 1, client publish and 103, recovery after a transport drop (exactly the
missed publications, once each) and past the ring (`recovered: false`), history, presence and join/leave,
rpc, pings keeping an idle connection, and bad input answered 107 / 3501 with nobody else disturbed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from centrifuge import (  # type: ignore[import-untyped]  # it ships no type information
    Client,
    ClientEventHandler,
    ConnectedContext,
    ConnectingContext,
    DisconnectedContext,
    JoinContext,
    LeaveContext,
    PublicationContext,
    SubscribedContext,
    SubscriptionEventHandler,
    UnsubscribedContext,
)
from centrifuge.exceptions import ReplyError  # type: ignore[import-untyped]
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import metric
from tests.gateway.test_centrifugo_client_units import replies_of

RULES = {
    "rules": [
        {"pattern": "hist.*", "kind": "ring", "capacity": 8, "anonymous": True, "client_publish": True},
        {"pattern": "room.*", "kind": "ring", "capacity": 64, "anonymous": True, "presence": True, "join_leave": True},
        {"pattern": "locked.*", "kind": "ring", "capacity": 64},
        {"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True, "client_publish": True},
    ]
}
PATH = "/connection/websocket"

_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}.{next(_names)}"


@pytest.fixture(scope="module")
def gw():
    with run_gateway(topics=RULES, centrifugo={"ping_interval_s": 1.0, "pong_timeout_s": 2.0}) as gateway:
        yield gateway


def publish(gw, channel: str, data: Any) -> int:
    """A publication through the Centrifugo server API: its offset."""
    answer = web.post(
        f"{gw.http_url}/api/publish",
        json={"channel": channel, "data": data},
        headers={"X-API-Key": gw.admin_token},
        trust_env=False,
    )
    return int(answer.json()["result"]["offset"])


class Events(ClientEventHandler):
    def __init__(self) -> None:
        self.connecting: list[int] = []
        self.connected: list[ConnectedContext] = []
        self.disconnected: list[DisconnectedContext] = []

    async def on_connecting(self, ctx: ConnectingContext) -> None:
        self.connecting.append(ctx.code)

    async def on_connected(self, ctx: ConnectedContext) -> None:
        self.connected.append(ctx)

    async def on_disconnected(self, ctx: DisconnectedContext) -> None:
        self.disconnected.append(ctx)


class SubEvents(SubscriptionEventHandler):
    def __init__(self) -> None:
        self.publications: list[tuple[int, Any]] = []
        self.subscribed: list[SubscribedContext] = []
        self.unsubscribed: list[UnsubscribedContext] = []
        self.joins: list[str] = []
        self.leaves: list[str] = []

    async def on_publication(self, ctx: PublicationContext) -> None:
        self.publications.append((ctx.pub.offset, ctx.pub.data))

    async def on_subscribed(self, ctx: SubscribedContext) -> None:
        self.subscribed.append(ctx)

    async def on_unsubscribed(self, ctx: UnsubscribedContext) -> None:
        self.unsubscribed.append(ctx)

    async def on_join(self, ctx: JoinContext) -> None:
        self.joins.append(ctx.info.client)

    async def on_leave(self, ctx: LeaveContext) -> None:
        self.leaves.append(ctx.info.client)


def client(url: str, events: Events | None = None, **options: Any) -> Client:
    options.setdefault("max_server_ping_delay", 3.0)
    return Client(url, events=events or Events(), proxy=None, min_reconnect_delay=0.05, max_reconnect_delay=0.5, **options)


async def until(predicate: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def subscribed(gw: Any, channel: str, **options: Any) -> tuple[Client, SubEvents]:
    """A connected SDK client whose subscription to `channel` (`options`: the subscription's) is subscribed."""
    c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}")
    events = SubEvents()
    sub = c.new_subscription(channel, events, **options)
    await c.connect()
    await sub.subscribe()
    await until(lambda: events.subscribed, "subscribed")
    return c, events


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


class Proxy:
    """A TCP relay between an SDK and the gateway whose connections the test cuts: a transport drop."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        #: while false, connections are closed at once: the SDK retries until `restore`
        self.accepting = True

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        """Drop the connections, and refuse new ones until `restore`."""
        self.accepting = False
        for writer in self.writers:
            writer.transport.abort()
        self.writers = []

    def restore(self) -> None:
        self.accepting = True

    async def stop(self) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()


# -- connect -------------------------------------------------------------------------------------------------


def test_connect_with_a_token_and_anonymously(gw):
    async def main() -> None:
        url = f"ws://127.0.0.1:{gw.http_port}{PATH}"
        alice = client(url, token=make_token("alice"))
        anonymous = client(url)
        await alice.connect()
        await anonymous.connect()
        await alice.ready(5)
        await anonymous.ready(5)
        assert (await alice.rpc("whoami", None)).data["user"] == "alice"
        who = (await anonymous.rpc("whoami", None)).data
        assert who["user"] is None and who["transport"] == "centrifugo" and who["client_id"].startswith("cf-")
        await alice.disconnect()
        await anonymous.disconnect()

    run(main())


def test_bad_and_expired_tokens_end_without_a_reconnect_loop(gw):
    async def main() -> None:
        url = f"ws://127.0.0.1:{gw.http_port}{PATH}"
        bad_events, expired_events = Events(), Events()
        bad = client(url, bad_events, token=make_token("bob", secret="not-the-secret-of-the-gateway-0000"))
        expired = client(url, expired_events, token=make_token("bob", ttl=-60))
        await bad.connect()
        await expired.connect()
        await until(lambda: bad_events.disconnected and expired_events.disconnected, "both disconnected")
        await asyncio.sleep(1.0)  # a loop would reconnect meanwhile
        assert [d.code for d in bad_events.disconnected] == [3500]
        assert len(bad_events.connecting) == 1 and not bad_events.connected
        assert len(expired_events.disconnected) == 1 and not expired_events.connected
        assert len(expired_events.connecting) <= 2  # 109: one more try with the same token, then unauthorized
        await bad.disconnect()
        await expired.disconnect()

    run(main())


# -- publications --------------------------------------------------------------------------------------------


def test_publications_arrive_in_order_with_offset_seq_plus_one(gw):
    channel = fresh("news")

    async def main() -> None:
        c, events = await subscribed(gw, channel, recoverable=True)
        offsets = [await asyncio.to_thread(publish, gw, channel, {"n": n}) for n in range(5)]
        await until(lambda: len(events.publications) == 5, "5 publications")
        assert events.publications == [(offset, {"n": n}) for n, offset in enumerate(offsets)]
        assert offsets == [1, 2, 3, 4, 5]  # seq 0.. + 1
        await c.disconnect()

    run(main())


def test_client_publish_and_permission_denied(gw):
    channel, locked = fresh("chat"), fresh("locked")

    async def main() -> None:
        c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}")
        events, locked_events = SubEvents(), SubEvents()
        sub = c.new_subscription(channel, events)
        refused = c.new_subscription(locked, locked_events)
        await c.connect()
        await sub.subscribe()
        await refused.subscribe()
        await until(lambda: events.subscribed and locked_events.unsubscribed, "subscribe answers")
        assert locked_events.unsubscribed[0].code == 103
        await c.publish(channel, {"text": "hi"})
        await until(lambda: events.publications, "own publication")
        assert events.publications == [(1, {"text": "hi"})]
        with pytest.raises(ReplyError) as refusal:
            await c.publish(locked, {"text": "no"})
        assert refusal.value.code == 103
        with pytest.raises(ReplyError) as unknown:
            await c.rpc("no-such-method", None)
        assert unknown.value.code == 104
        await c.disconnect()

    run(main())


# -- recovery ------------------------------------------------------------------------------------------------


def test_recovery_after_a_transport_drop_and_past_the_ring(gw):
    channel = fresh("hist")  # a ring of 8

    async def main() -> None:
        proxy = Proxy(gw.http_port)
        port = await proxy.start()
        events, sub_events = Events(), SubEvents()
        c = client(f"ws://127.0.0.1:{port}{PATH}", events)
        sub = c.new_subscription(channel, sub_events, recoverable=True)
        await c.connect()
        await sub.subscribe()
        await until(lambda: sub_events.subscribed, "subscribed")
        for n in range(2):
            await asyncio.to_thread(publish, gw, channel, n)
        await until(lambda: len(sub_events.publications) == 2, "2 publications")

        proxy.cut()  # missed: 2, 3, 4, all in the ring
        await until(lambda: len(events.connecting) >= 2, "reconnecting")
        for n in range(2, 5):
            await asyncio.to_thread(publish, gw, channel, n)
        proxy.restore()
        await until(lambda: len(sub_events.subscribed) == 2, "subscribed again")
        assert sub_events.subscribed[1].recovered and sub_events.subscribed[1].was_recovering
        await until(lambda: len(sub_events.publications) == 5, "the missed publications")
        await asyncio.sleep(0.3)
        assert sub_events.publications == [(n + 1, n) for n in range(5)]

        proxy.cut()  # missed: 12 publications, the ring holds 8
        await until(lambda: len(events.connecting) >= 3, "reconnecting")
        for n in range(5, 17):
            await asyncio.to_thread(publish, gw, channel, n)
        proxy.restore()
        await until(lambda: len(sub_events.subscribed) == 3, "subscribed a third time")
        assert not sub_events.subscribed[2].recovered and sub_events.subscribed[2].was_recovering
        await asyncio.to_thread(publish, gw, channel, 17)
        await until(lambda: len(sub_events.publications) == 6, "a live publication")
        await asyncio.sleep(0.3)
        assert sub_events.publications[5:] == [(18, 17)]  # none of the unrecoverable ones, no duplicate
        await c.disconnect()
        await proxy.stop()

    run(main())


# -- history, presence, rpc ------------------------------------------------------------------------------------


def test_history(gw):
    channel = fresh("hist")

    async def main() -> None:
        for n in range(10):
            await asyncio.to_thread(publish, gw, channel, n)
        c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}")
        await c.connect()
        position = await c.history(channel)  # limit 0: the position only
        assert position.publications == [] and position.offset == 10 and position.epoch
        everything = await c.history(channel, limit=-1)
        assert [(p.offset, p.data) for p in everything.publications] == [(n + 1, n) for n in range(2, 10)]
        newest = await c.history(channel, limit=2, reverse=True)
        assert [p.offset for p in newest.publications] == [10, 9]
        await c.disconnect()

    run(main())


def test_presence_and_join_leave(gw):
    channel = fresh("room")

    async def main() -> None:
        url = f"ws://127.0.0.1:{gw.http_port}{PATH}"
        a, b = client(url, token=make_token("ann")), client(url)
        a_events, b_events = SubEvents(), SubEvents()
        a_sub = a.new_subscription(channel, a_events, join_leave=True)
        b_sub = b.new_subscription(channel, b_events, join_leave=True)
        await a.connect()
        await a_sub.subscribe()
        await until(lambda: a_events.subscribed, "a subscribed")
        await b.connect()
        await b_sub.subscribe()
        await until(lambda: b_events.subscribed, "b subscribed")
        b_id = (await b.rpc("whoami", None)).data["client_id"]
        await until(lambda: a_events.joins, "join")
        assert a_events.joins == [b_id]
        presence = await a.presence(channel)
        assert {info.user for info in presence.clients.values()} == {"ann", ""}
        assert b_id in presence.clients
        stats = await a.presence_stats(channel)
        assert (stats.num_clients, stats.num_users) == (2, 2)
        await b_sub.unsubscribe()
        await until(lambda: a_events.leaves, "leave")
        assert a_events.leaves == [b_id]
        await a.disconnect()
        await b.disconnect()

    run(main())


def test_rpc(gw):
    async def main() -> None:
        c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}")
        await c.connect()
        assert (await c.rpc("echo", {"a": [1, 2]})).data == {"a": [1, 2]}
        await c.disconnect()

    run(main())


# -- pings ---------------------------------------------------------------------------------------------------


def test_an_idle_connection_is_kept_alive_by_pings(gw):
    async def main() -> None:
        events = Events()
        # the SDK gives up after ping (1 s) + 0.5 s without a ping: it must see one every second
        c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}", events, max_server_ping_delay=0.5)
        await c.connect()
        await c.ready(5)
        # 3 s: a gateway that never pings is left at 1.5 s, one that stops after its first ping at 2.5 s
        await asyncio.sleep(3.0)
        assert len(events.connecting) == 1 and len(events.connected) == 1 and not events.disconnected
        await c.disconnect()

    run(main())


def raw(gw, query: str = ""):
    return connect(
        f"ws://127.0.0.1:{gw.http_port}{PATH}{query}",
        subprotocols=[Subprotocol("centrifuge-json")],
        open_timeout=5,
        compression=None,
    )


def closed_with(ws, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ws.recv(timeout=deadline - time.monotonic())
    except ConnectionClosed as exc:
        assert exc.rcvd is not None
        return exc.rcvd.code
    raise AssertionError("not closed")


def test_no_pong_closes_3012(gw):
    with raw(gw) as ws:
        assert ws.subprotocol == "centrifuge-json"
        ws.send(json.dumps({"id": 1, "connect": {}}))
        assert json.loads(ws.recv(timeout=5))["connect"]["ping"] == 1
        assert ws.recv(timeout=5) == "{}"  # the ping, never answered
        assert closed_with(ws) == 3012


# -- bad input -------------------------------------------------------------------------------------------------


def test_bad_input_gets_107_or_3501_and_disturbs_nobody(gw):
    channel = fresh("calm")

    async def main() -> None:
        c, events = await subscribed(gw, channel)

        def abuse() -> None:
            with raw(gw) as ws:  # a command before connect
                ws.send(json.dumps({"id": 1, "subscribe": {"channel": channel}}))
                assert closed_with(ws) == 3501
            with raw(gw) as ws:  # not JSON
                ws.send("{nope")
                assert closed_with(ws) == 3501
            with raw(gw) as ws:  # a bad field: 107, the connection goes on
                ws.send(json.dumps({"id": 1, "connect": {}}) + "\n" + json.dumps({"id": 2, "subscribe": {"channel": 5}}))
                assert "connect" in json.loads(ws.recv(timeout=5))
                lines = [json.loads(line) for line in ws.recv(timeout=5).split("\n")]
                assert lines[0]["id"] == 2 and lines[0]["error"]["code"] == 107
                ws.send(json.dumps({"id": 3, "unsubscribe": {"channel": "never.subscribed"}}))
                assert json.loads(ws.recv(timeout=5)) == {"id": 3, "unsubscribe": {}}
                ws.send(json.dumps({"id": 4, "publish": {"channel": "bad name", "data": 1}}))
                assert json.loads(ws.recv(timeout=5))["error"]["code"] == 107
                ws.send(json.dumps({"id": 5, "connect": {}}))  # twice
                assert closed_with(ws) == 3501
            with raw(gw) as ws:  # the frame bound of /ws (websocket.max_frame_bytes)
                ws.send(json.dumps({"id": 1, "connect": {}}))
                ws.recv(timeout=5)
                ws.send(json.dumps({"id": 2, "rpc": {"method": "echo", "data": "x" * (2 << 20)}}))
                assert closed_with(ws) == 1009

        await asyncio.to_thread(abuse)
        await asyncio.to_thread(publish, gw, channel, "still here")
        await until(lambda: events.publications, "the publication")
        assert events.publications == [(1, "still here")]
        await c.disconnect()

    run(main())


# -- falling behind the ring --------------------------------------------------------------------------------------


def test_a_subscriber_behind_the_ring_is_told_to_subscribe_again():
    config = {
        "websocket": {"write_high_water": 16384, "blocked_timeout_s": 30.0},
        "topics": {"rules": [{"pattern": "*", "kind": "ring", "capacity": 8, "anonymous": True}]},
    }
    payload = "x" * 20000
    with run_gateway(**config) as gw:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gw.http_port))
        with connect(
            f"ws://127.0.0.1:{gw.http_port}{PATH}",
            sock=sock,
            open_timeout=5,
            compression=None,
            max_size=None,
            max_queue=4,
            subprotocols=[Subprotocol("centrifuge-json")],
        ) as ws:
            ws.send(
                json.dumps({"id": 1, "connect": {}})
                + "\n"
                + json.dumps({"id": 2, "subscribe": {"channel": "t", "recoverable": True}})
            )
            replies = []
            while not any(r.get("id") == 2 for r in replies):
                replies += [json.loads(line) for line in ws.recv(timeout=5).split("\n")]
            epoch = [r for r in replies if r.get("id") == 2][0]["subscribe"]["epoch"]
            for n in range(30):  # the reader does not read meanwhile: it falls behind the ring of 8
                publish(gw, "t", {"n": n, "pad": payload})
            offsets, unsubscribed = [], None
            while unsubscribed is None:
                for line in ws.recv(timeout=10).split("\n"):
                    push = json.loads(line).get("push", {})
                    if "unsubscribe" in push:
                        unsubscribed = push["unsubscribe"]
                    elif "pub" in push:
                        offsets.append(push["pub"]["offset"])
            assert unsubscribed["code"] == 2500  # insufficient state: the SDKs subscribe again
            assert offsets == list(range(1, len(offsets) + 1)) and len(offsets) < 30  # no gap before it
            last = offsets[-1]
            ws.send(
                json.dumps(
                    {"id": 3, "subscribe": {"channel": "t", "recoverable": True, "recover": True, "offset": last, "epoch": epoch}}
                )
            )
            answer = None
            while answer is None:
                for line in ws.recv(timeout=10).split("\n"):
                    reply = json.loads(line)
                    if reply.get("id") == 3:
                        answer = reply
            assert "error" not in answer, answer  # the lost subscription was dropped: no 105
            assert answer["subscribe"]["was_recovering"] and not answer["subscribe"].get("recovered")
            assert answer["subscribe"]["offset"] == 30


# -- shared frames ---------------------------------------------------------------------------------------------


def test_one_publication_reaches_ws_json_and_protobuf_clients_each_in_its_form(gw):
    """Small frames too (below websocket.compression_min_bytes, which once made /ws and Centrifugo sockets
    one crowd of the fan-out writer): every client gets its own protocol's bytes."""
    channel = fresh("mixed")
    with contextlib.ExitStack() as stack:
        cf_clients = [stack.enter_context(raw(gw)) for _ in range(4)]
        pb_clients = [
            stack.enter_context(connect(f"ws://127.0.0.1:{gw.http_port}{PATH}?format=protobuf", open_timeout=5, compression=None))
            for _ in range(2)
        ]
        ws_clients = [stack.enter_context(connect(gw.ws_url, open_timeout=5, compression=None)) for _ in range(4)]
        mixed_clients(gw, channel, cf_clients, pb_clients, ws_clients)


def test_caught_up_centrifugo_subscribers_go_in_the_engines_crowds(gw):
    """A Centrifugo client on plain TCP joins the crowds the engine gathers, as a `/ws` client does: a
    publication is converted once per codec for the whole crowd, and every client gets each one, in order,
    in its own form."""
    channel = fresh("crowd")
    before = metric(gw, "fanout_gathered_writes_total")
    with contextlib.ExitStack() as stack:
        cf_clients = [stack.enter_context(raw(gw)) for _ in range(4)]
        pb_clients = [
            stack.enter_context(connect(f"ws://127.0.0.1:{gw.http_port}{PATH}?format=protobuf", open_timeout=5, compression=None))
            for _ in range(2)
        ]
        mixed_clients(gw, channel, cf_clients, pb_clients, [])
    # 20 publications, one at a time, to 6 caught-up clients: most went in crowds (not one by one)
    assert metric(gw, "fanout_gathered_writes_total") - before >= 60


def mixed_clients(gw, channel: str, cf_clients: list, pb_clients: list, ws_clients: list) -> None:
    for ws in cf_clients:
        ws.send(json.dumps({"id": 1, "connect": {}}) + "\n" + json.dumps({"id": 2, "subscribe": {"channel": channel}}))
    for ws in pb_clients:  # Command{id: 1, connect: {}}, Command{id: 2, subscribe: {channel}}
        name = channel.encode()
        sub = b"\x0a" + bytes((len(name),)) + name
        command = b"\x08\x02\x2a" + bytes((len(sub),)) + sub
        ws.send(b"\x04\x08\x01\x22\x00" + bytes((len(command),)) + command)
    for ws in ws_clients:
        ws.send(json.dumps({"op": "subscribe", "topic": channel, "id": 1}))
    answered = 0
    for ws in cf_clients + pb_clients + ws_clients:
        got = b""
        while b"subscribe" not in got and b"\x32" not in got[-40:]:  # JSON reply, or Reply field 6
            frame = ws.recv(timeout=5)
            got += frame if isinstance(frame, bytes) else frame.encode()
        answered += 1
    assert answered == len(cf_clients) + len(pb_clients) + len(ws_clients)
    for n in range(20):
        publish(gw, channel, n)
    for ws in cf_clients:
        offsets: list[int] = []
        while len(offsets) < 20:
            frame = ws.recv(timeout=5)
            assert isinstance(frame, str)
            offsets += [json.loads(line)["push"]["pub"]["offset"] for line in frame.split("\n") if '"pub"' in line]
        assert offsets == list(range(1, 21))
    for ws in pb_clients:
        pb_offsets: list[int] = []
        while len(pb_offsets) < 20:
            frame = ws.recv(timeout=5)
            assert isinstance(frame, bytes)
            pb_offsets += [reply.push.pub.offset for reply in replies_of(frame) if reply.push.HasField("pub")]
        assert pb_offsets == list(range(1, 21))
    for ws in ws_clients:
        seqs: list[int] = []
        while len(seqs) < 20:
            frame = ws.recv(timeout=5)
            assert isinstance(frame, str)
            seqs += [e["seq"] for e in json.loads(frame) if e["type"] == "msg"]
        assert seqs == list(range(20))


def test_the_path_is_not_served_when_disabled():
    with run_gateway(centrifugo={"enabled": False}) as gw:
        with pytest.raises(InvalidStatus) as refused:
            connect(f"ws://127.0.0.1:{gw.http_port}{PATH}", open_timeout=5).close()
        assert refused.value.response.status_code == 404
        with connect(gw.ws_url, open_timeout=5) as ws:  # ours is still there
            ws.send(json.dumps({"op": "ping", "id": 1}))
            assert json.loads(ws.recv(timeout=5))[0]["result"] == "pong"


def test_the_per_user_limit_and_a_revocation_close_with_final_codes():
    with run_gateway(topics=RULES, limits={"max_connections_per_user": 1}) as gw:
        token = make_token("carol")
        with raw(gw) as older, raw(gw) as newer:
            older.send(json.dumps({"id": 1, "connect": {"token": token}}))
            assert "connect" in json.loads(older.recv(timeout=5))
            newer.send(json.dumps({"id": 1, "connect": {"token": token}}))
            assert "connect" in json.loads(newer.recv(timeout=5))
            assert closed_with(older) == 3504  # the oldest gives way, and its SDK does not come back
            answer = web.post(
                f"{gw.http_url}/api/revocations",
                json={"user": "carol"},
                trust_env=False,
                headers={"Authorization": f"Bearer {gw.admin_token}"},
            )
            assert answer.status_code == 201
            assert closed_with(newer) == 3500
