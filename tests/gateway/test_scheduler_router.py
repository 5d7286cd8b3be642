"""The scheduler, the client registry and the topic router over fake connections: no socket, no server.

Each test runs the real hub (in-process broker) on an event loop of its own and plays a transport: a
`FakeConnection` records what the scheduler hands it and can refuse to drain or break mid-write.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from core import QueueFull, Sink
from gateway import close_codes, scheduler
from gateway.auth.identity import ClientIdentity
from gateway.auth.tokens import Principal
from gateway.config import load_config
from gateway.hub import Hub
from gateway.scheduler import Delivered
from gateway.testing import DEFAULTS

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.last_command = time.monotonic()


class FakeSession:
    """What the registry reads of a connection's session: its idle clock; no token ever renews it here."""

    def __init__(self) -> None:
        self.state = FakeClock()

    def authenticate(self, principal: Principal) -> Principal:
        raise AssertionError("not renewed in these tests")


class FakeConnection:
    """A transport's connection as the scheduler sees it: `deliver`, `flush`, `kick`, `describe`."""

    def __init__(self, client_id: str, *, drains: bool = True, breaks: bool = False) -> None:
        self.identity = ClientIdentity(client_id, "fake", ip="127.0.0.1")
        self.session = FakeSession()
        self.blocked_since: float | None = None
        self.drains = drains
        self.breaks = breaks
        self.entries: list[dict[str, Any]] = []
        self.kicked: tuple[int, str] | None = None

    def deliver(self, batch: Any, frame: bytes) -> Delivered:
        if self.breaks:
            raise RuntimeError("the socket broke")
        self.entries += orjson.loads(frame)
        return Delivered.DONE if self.drains else Delivered.BLOCKED

    def flush(self) -> bool:
        return True

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        self.kicked = (code, reason)

    def describe(self) -> dict[str, Any]:
        return {"transport": "fake"}


def run(test: Callable[[Hub], Awaitable[None]], **overrides: Any) -> None:
    async def main() -> None:
        hub = Hub(load_config(overrides={**DEFAULTS, **overrides}, environ={}), instance_id="unit")
        await hub.start()
        try:
            await test(hub)
        finally:
            await hub.stop()

    asyncio.run(main())


async def settle(until: Callable[[], bool], timeout: float = 2.0) -> None:
    """Let the scheduler task run until `until()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not until():
        assert asyncio.get_running_loop().time() < deadline, "the scheduler did not deliver"
        await asyncio.sleep(0.001)


def connect(hub: Hub, client_id: str, **kwargs: Any) -> FakeConnection:
    conn = FakeConnection(client_id, **kwargs)
    hub.clients.register(conn, ready=True)
    return conn


async def subscribed(hub: Hub, client_id: str, topic: str, **kwargs: Any) -> FakeConnection:
    """A fake client subscribed to `topic`, its `subscribed` entry delivered."""
    conn = connect(hub, client_id, **kwargs)
    hub.catalog.subscribe(client_id, topic)
    await settle(lambda: bool(conn.entries))
    return conn


def messages(conn: FakeConnection) -> list[Any]:
    return [e["data"] for e in conn.entries if e["type"] == "msg"]


def test_subscribe_and_publish_take_one_path_and_reach_every_subscriber():
    async def test(hub: Hub) -> None:
        a, b = connect(hub, "a"), connect(hub, "b")
        for conn in (a, b):
            hub.catalog.subscribe(conn.identity.client_id, "chat.room", request_id=1)
        await settle(lambda: all(any(e["type"] == "subscribed" for e in c.entries) for c in (a, b)))
        published = await hub.catalog.publish("chat.room", {"n": 1})
        assert published.seq == 0
        assert hub.catalog.publish_nowait("chat.room", {"n": 2}).seq == 1  # type: ignore[union-attr]  # the in-process fast path
        await settle(lambda: len(messages(a)) == 2 and len(messages(b)) == 2)
        assert messages(a) == messages(b) == [{"n": 1}, {"n": 2}]

    run(test)


def test_a_client_publish_is_answered_with_its_seq():
    async def test(hub: Hub) -> None:
        a = connect(hub, "a")
        hub.catalog.subscribe("a", "chat.x")
        hub.catalog.publish_reply("a", "chat.x", "hello", request_id=7)
        await settle(lambda: any(e["type"] == "reply" for e in a.entries))
        reply = next(e for e in a.entries if e["type"] == "reply")
        assert (reply["id"], reply["result"]) == (7, {"seq": 0})

    run(test)


def test_a_broken_connection_is_kicked_and_the_others_still_get_the_message():
    async def test(hub: Hub) -> None:
        good, bad = connect(hub, "good"), connect(hub, "bad")
        for conn in (good, bad):
            hub.catalog.subscribe(conn.identity.client_id, "chat.t")
        await settle(lambda: bool(good.entries))
        bad.breaks = True
        hub.catalog.publish_nowait("chat.t", "m")
        await settle(lambda: messages(good) == ["m"])
        assert bad.kicked == (close_codes.INTERNAL_ERROR, "internal error")
        assert "bad" not in hub.clients.conns and not hub.scheduler.engine.has_client("bad")
        assert hub.clients.disconnects[("fake", "error")] == 1

    run(test)


def test_a_client_that_does_not_drain_gets_nothing_until_it_does():
    async def test(hub: Hub) -> None:
        slow = await subscribed(hub, "slow", "chat.s", drains=False)
        hub.catalog.publish_nowait("chat.s", 1)
        await asyncio.sleep(0.05)
        assert messages(slow) == []  # its `subscribed` write has not drained: not ready
        hub.scheduler.write_drained("slow")
        await settle(lambda: messages(slow) == [1])

    run(test)


class SocketConnection(FakeConnection):
    """A connection the fan-out writer may write directly: one end of a socketpair; what the writer's
    socket did not take is kept as the transport's buffer (`rest`) until `write_drained`. `gathered`: it
    offers a sink, so the engine gathers its caught-up batches into crowds (it is its own transport there);
    else each batch is handed out (`direct_fd`)."""

    def __init__(self, client_id: str, gathered: bool = False) -> None:
        super().__init__(client_id)
        self.sock, self.peer = socket.socketpair()
        self.sock.setblocking(False)
        self.rest: list[tuple[bytes, int]] = []
        self.crowd_sink = Sink(self.sock.fileno(), 0, self, self) if gathered else None

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return sum(len(data) - max(sent, 0) for data, sent in self.rest)

    def direct_fd(self, batch: Any, frame: bytes) -> int:
        return -1 if self.rest or batch.more else self.sock.fileno()

    wire_variant = 0

    def wire(self, frame: bytes, count: int) -> bytes:
        return b"%08d" % len(frame) + frame  # length-prefixed, so `received` can split the stream

    def gathered_wire(self, entry: bytes, frame: bytes, sinks: list[Sink]) -> bytes:
        return self.wire(frame, len(sinks))

    def write_rest(self, data: bytes, sent: int) -> bool:
        self.rest.append((data, sent))
        self.blocked_since = 1.0  # above the high-water mark: blocked until `write_drained`
        return False

    def received(self) -> list[Any]:
        chunks = []
        with contextlib.suppress(BlockingIOError):
            while chunk := self.peer.recv(1 << 20, socket.MSG_DONTWAIT):
                chunks.append(chunk)
        stream, entries = b"".join(chunks), []
        while stream:
            size = int(stream[:8])
            entries += orjson.loads(stream[8 : 8 + size])
            stream = stream[8 + size :]
        return entries


@pytest.mark.parametrize("gathered", [True, False], ids=["crowds", "handed-out"])
@pytest.mark.parametrize("crowd_slice", [512, 2])  # 2: a crowd written in slices of two sockets
def test_caught_up_clients_get_one_frame_written_to_all_their_sockets_in_one_call(
    crowd_slice: int, gathered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler, "CROWD_SLICE", crowd_slice)

    async def test(hub: Hub) -> None:
        crowd = [SocketConnection(f"s{i}", gathered) for i in range(5)]
        for conn in crowd:
            hub.clients.register(conn, ready=True)
            hub.catalog.subscribe(conn.identity.client_id, "chat.crowd")
        other = await subscribed(hub, "f", "chat.crowd")  # a transport the writer may not write
        # which connections the writer may write is known once, at registration: those `DirectWritable`
        assert set(hub.scheduler.writable_sockets) == {conn.identity.client_id for conn in crowd}
        await settle(lambda: hub.scheduler.direct_writes == 5)  # their `subscribed` entries
        hub.catalog.publish_nowait("chat.crowd", "m1")
        await settle(lambda: hub.scheduler.direct_writes == 10 and messages(other) == ["m1"])
        for conn in crowd:
            got = conn.received()
            assert [e["type"] for e in got] == ["subscribed", "msg"] and got[1]["data"] == "m1"
        # with sinks the engine gathered them (and counted the message in each sink); the notices, each
        # client's own, were handed out
        assert [conn.crowd_sink.frames if conn.crowd_sink else None for conn in crowd] == [1 if gathered else None] * len(crowd)
        hub.clients.unregister(crowd[0].identity.client_id, "closed")
        assert crowd[0].identity.client_id not in hub.scheduler.writable_sockets

    run(test)


@pytest.mark.parametrize("gathered", [True, False], ids=["crowds", "handed-out"])
@pytest.mark.parametrize("crowd_slice", [512, 2])  # 2: the full socket is the first of the second slice
def test_a_socket_that_takes_less_hands_the_rest_to_its_transport_and_waits_for_it_to_drain(
    crowd_slice: int, gathered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler, "CROWD_SLICE", crowd_slice)

    async def test(hub: Hub) -> None:
        fine = [SocketConnection("fine0", gathered), SocketConnection("fine1", gathered)]
        full = SocketConnection("full", gathered)
        fine.append(SocketConnection("fine2", gathered))
        for conn in (*fine[:2], full, fine[2]):
            hub.clients.register(conn, ready=True)
            hub.catalog.subscribe(conn.identity.client_id, "chat.full")
        await settle(lambda: hub.scheduler.direct_writes == 4)
        assert [e["type"] for e in full.received()] == ["subscribed"]
        full.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with contextlib.suppress(BlockingIOError):  # the peer reads nothing: its buffers fill up
            while True:
                full.sock.send(b"x" * 4096)
        hub.catalog.publish_nowait("chat.full", "m1")
        got: list[list[Any]] = [[] for _ in fine]

        def all_got(data: str) -> bool:
            for mine, conn in zip(got, fine):
                mine += conn.received()
            return all(any(e.get("data") == data for e in mine) for mine in got)

        await settle(lambda: bool(full.rest) and all_got("m1"))
        ((data, sent),) = full.rest
        assert sent == -errno.EAGAIN and b'"m1"' in data and len(data) == int(data[:8]) + 8  # all of it
        assert hub.scheduler.direct_shortfalls == 1
        hub.catalog.publish_nowait("chat.full", "m2")  # not ready until its transport drains
        await settle(lambda: all_got("m2"))
        assert len(full.rest) == 1
        full.rest.clear()
        hub.scheduler.write_drained("full")
        await settle(lambda: hub.scheduler.direct_writes == 4 + 3 + 3 + 1)

    run(test)


def test_a_full_private_queue_holds_a_publish_with_a_timeout_until_it_has_room():
    async def test(hub: Hub) -> None:
        reader = await subscribed(hub, "reader", "private.inbox", drains=False)
        for i in range(2):
            hub.catalog.publish_nowait("private.inbox", i, owner="reader")
        with pytest.raises(QueueFull):
            await hub.catalog.publish("private.inbox", "no room", owner="reader")
        held = hub.catalog.publish("private.inbox", "waits", owner="reader", timeout=2.0)
        await asyncio.sleep(0.05)
        assert not held.done()
        reader.drains = True
        hub.scheduler.write_drained("reader")  # its writes drained: what they carried leaves the queue
        assert (await asyncio.wait_for(held, 2.0)).seq == 2
        await settle(lambda: messages(reader) == [0, 1, "waits"])

    run(test, topics={"rules": [{"pattern": "private.*", "kind": "private", "anonymous": True, "max_count": 2}]})


def test_kick_closes_with_the_code_and_unregisters():
    async def test(hub: Hub) -> None:
        conn = connect(hub, "k")
        hub.catalog.subscribe("k", "chat.k")
        assert hub.clients.kick("k", close_codes.KICKED, "kicked by admin", "kicked")
        assert conn.kicked == (close_codes.KICKED, "kicked by admin")
        assert hub.clients.by_transport["fake"] == 0 and not hub.clients.clients_by_ip
        assert not hub.clients.kick("k", close_codes.KICKED, "again", "kicked")

    run(test)


def test_the_router_creates_and_deletes_topics_through_the_broker():
    async def test(hub: Hub) -> None:
        from core import TopicConfig

        info = await hub.catalog.create_topic("made.here", TopicConfig())
        assert info["name"] == "made.here"
        assert [t["name"] for t in await hub.catalog.topics_info()] == ["made.here"]
        a = connect(hub, "a")
        hub.catalog.subscribe("a", "made.here")
        assert await hub.catalog.delete_topic("made.here") == 1
        await settle(lambda: any(e["type"] == "closed" for e in a.entries))

    run(test)


def test_metrics_come_from_each_part():
    async def test(hub: Hub) -> None:
        connect(hub, "m")
        text = hub.metrics.render().decode()
        for family in (
            'fanout_clients{transport="fake"} 1.0',
            "fanout_rounds_total",
            "fanout_topics ",
            "fanout_bad_input_total",
            "fanout_topic_creations_refused_total",
            "fanout_gc_full_collections",
        ):
            assert family in text, family

    run(test)
