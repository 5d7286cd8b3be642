"""gateway.transports.rawtcp against a real server on 127.0.0.1 with ephemeral ports and real sockets
(docs/design/byte-ring.md)."""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
from collections.abc import Awaitable, Callable

import pytest

from core.byte_ring import ByteRingConfig
from gateway.transports.rawtcp import RawBroadcastServer, _ReceiverProtocol, _SenderProtocol

HOST = "127.0.0.1"
KIB = 1024
MIB = 1024 * KIB

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency of the gateway
    uvloop = None  # type: ignore[assignment]

LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(uvloop is None, reason="no uvloop"))]


def run(main: Callable[[], Awaitable[None]], loop_kind: str = "asyncio", timeout: float = 9.0) -> None:
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(main(), timeout))


def make_config(**kw) -> ByteRingConfig:
    base = dict(
        capacity_bytes=4 * MIB,
        soft_lag_bytes=512 * KIB,
        hard_lag_bytes=1 * MIB,
        kick_grace_ms=300,
        pause_watermark_pct=80,
        resume_watermark_pct=55,
        recv_chunk_bytes=64 * KIB,
        max_receivers=16,
    )
    base.update(kw)
    return ByteRingConfig(**base)


async def started(cfg: ByteRingConfig) -> RawBroadcastServer:
    server = RawBroadcastServer(cfg, check_interval=0.02)
    await server.start(HOST, 0, 0)
    assert server.sender_port and server.receiver_port and server.sender_port != server.receiver_port
    return server


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Reader:
    """A receiver client that reads as fast as it can and hashes what it gets."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.sha = hashlib.sha256()
        self.count = 0
        self.eof = False

    async def read_until(self, total: int) -> None:
        while self.count < total:
            data = await self.reader.read(min(1 * MIB, total - self.count))
            if not data:
                self.eof = True
                return
            self.sha.update(data)
            self.count += len(data)

    def close(self) -> None:
        self.writer.close()


async def connect_reader(server: RawBroadcastServer) -> Reader:
    return Reader(*await asyncio.open_connection(HOST, server.receiver_port))


async def connect_stalled(server: RawBroadcastServer) -> socket.socket:
    """A receiver that never reads, with a tiny receive buffer so the kernel absorbs little."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, server.receiver_port))
    return sock


async def push(writer: asyncio.StreamWriter, data: bytes, chunk: int = 200 * KIB) -> None:
    view = memoryview(data)
    for i in range(0, len(view), chunk):
        writer.write(view[i : i + chunk])
        await writer.drain()


async def push_forever(writer: asyncio.StreamWriter, chunk: bytes = b"\xab" * (128 * KIB)) -> None:
    while True:
        writer.write(chunk)
        await writer.drain()


# ------------------------------------------------------------------ fan-out


@pytest.mark.timeout(10)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_one_sender_three_receivers_byte_exact(loop_kind):
    total = 12 * MIB
    payload = random.Random(3).randbytes(total)
    want = hashlib.sha256(payload).hexdigest()

    async def main():
        server = await started(make_config(kick_grace_ms=5000))
        try:
            readers = [await connect_reader(server) for _ in range(3)]
            await wait_until(lambda: server.stats()["active_receivers"] == 3, what="3 receivers")
            _, sender = await asyncio.open_connection(HOST, server.sender_port)
            # Odd chunk sizes so reads, ring wraps (12 MiB through 4 MiB) and writes never line up.
            await asyncio.gather(push(sender, payload, chunk=123_457), *(r.read_until(total) for r in readers))
            for r in readers:
                assert r.count == total and r.sha.hexdigest() == want
            stats = server.stats()
            assert stats["bytes_received"] == total
            assert stats["bytes_dropped_no_receiver"] == 0
            assert stats["disconnections_lag"] == 0
            assert stats["total_connections"] == 3
            await wait_until(lambda: server.stats()["bytes_sent"] == 3 * total, what="all released")
            assert server.stats()["ring_buffer_used"] == 0
            rows = server.receivers()
            assert len(rows) == 3
            assert {row["state"] for row in rows} == {"healthy"}
            assert all(row["bytes_sent"] == total and row["lag"] == 0 for row in rows)
            assert all(row["peer"][0] == HOST for row in rows)
            sender.close()
            for r in readers:
                r.close()
        finally:
            await server.stop()

    run(main, loop_kind)


# ---------------------------------------------------------------- lag policy


@pytest.mark.timeout(10)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_stalled_receiver_is_kicked_while_others_keep_receiving(loop_kind):
    total = 16 * MIB
    payload = random.Random(7).randbytes(total)
    want = hashlib.sha256(payload).hexdigest()

    async def main():
        server = await started(make_config(kick_grace_ms=300))
        try:
            stalled = await connect_stalled(server)
            readers = [await connect_reader(server) for _ in range(2)]
            await wait_until(lambda: server.stats()["active_receivers"] == 3, what="3 receivers")
            _, sender = await asyncio.open_connection(HOST, server.sender_port)
            tasks = [asyncio.ensure_future(r.read_until(total)) for r in readers]
            pushing = asyncio.ensure_future(push(sender, payload))
            await wait_until(lambda: server.stats()["disconnections_lag"] == 1, what="the kick")
            stats = server.stats()
            assert stats["active_receivers"] == 2
            at_kick = [r.count for r in readers]
            await asyncio.gather(pushing, *tasks)
            for r, before in zip(readers, at_kick):
                assert r.count == total > before  # they went on after the kick, byte-exact
                assert r.sha.hexdigest() == want
            # The stalled client finds its connection dropped once it reads what its kernel holds.
            loop = asyncio.get_running_loop()
            got = 0
            while True:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(stalled, 1 * MIB), 2)
                except ConnectionResetError:
                    break
                if not data:
                    break
                got += len(data)
            assert got < total
            stalled.close()
            sender.close()
            for r in readers:
                r.close()
        finally:
            await server.stop()

    run(main, loop_kind)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_sender_paused_at_watermark_and_resumed_when_slow_receiver_goes(loop_kind):
    async def main():
        # Grace far longer than the test: only the slow receiver leaving can release the sender.
        cfg = make_config(kick_grace_ms=60_000)
        server = await started(cfg)
        try:
            stalled = await connect_stalled(server)
            healthy = await connect_reader(server)
            await wait_until(lambda: server.stats()["active_receivers"] == 2, what="2 receivers")
            _, sender = await asyncio.open_connection(HOST, server.sender_port)
            pushing = asyncio.ensure_future(push_forever(sender))
            reading = asyncio.ensure_future(healthy.read_until(1 << 62))

            await wait_until(lambda: server.stats()["paused"], what="the pause")
            stats = server.stats()
            assert stats["sender_recv_pause_count"] == 1
            assert not stats["sender_reading"]
            # docs/design/byte-ring.md §5: paused at used >= 80 % of capacity or free < recv_chunk_bytes
            assert (
                stats["ring_buffer_used"] >= cfg.pause_threshold_bytes
                or cfg.capacity_bytes - stats["ring_buffer_used"] < cfg.recv_chunk_bytes
            )
            received = stats["bytes_received"]
            await asyncio.sleep(0.3)
            stats = server.stats()
            assert stats["bytes_received"] == received  # reading stopped
            assert stats["paused"] and stats["sender_recv_pause_count"] == 1
            assert stats["sender_recv_pause_ns"] >= 250_000_000
            assert stats["disconnections_lag"] == 0
            healthy_before = healthy.count
            assert {row["state"] for row in server.receivers()} >= {"lagging"}

            stalled.close()  # unread data: the kernel resets the connection
            await wait_until(lambda: server.stats()["active_receivers"] == 1, what="slow receiver gone")
            await wait_until(lambda: not server.stats()["paused"], what="the resume")
            await wait_until(lambda: server.stats()["bytes_received"] > received + 4 * MIB, what="reading again")
            await wait_until(lambda: healthy.count > healthy_before + 4 * MIB, what="healthy receiver fed")
            pushing.cancel()
            reading.cancel()
            sender.close()
            healthy.close()
        finally:
            await server.stop()

    run(main, loop_kind)


# -------------------------------------------------------------------- drain


@pytest.mark.timeout(10)
def test_drain_mode_counts_dropped_bytes_and_does_not_replay():
    async def main():
        server = await started(make_config())
        try:
            _, sender = await asyncio.open_connection(HOST, server.sender_port)
            await wait_until(lambda: server.stats()["sender_connected"], what="sender")
            await push(sender, b"d" * (6 * MIB))  # more than the ring holds: nothing is stored
            await wait_until(lambda: server.stats()["bytes_dropped_no_receiver"] == 6 * MIB, what="drops")
            stats = server.stats()
            assert stats["bytes_received"] == 6 * MIB
            assert stats["ring_buffer_used"] == 0 and not stats["paused"]

            receiver = await connect_reader(server)
            await wait_until(lambda: server.stats()["active_receivers"] == 1, what="receiver")
            sender.write(b"after the join")
            await sender.drain()
            data = await asyncio.wait_for(receiver.reader.readexactly(14), 3)
            assert data == b"after the join"  # nothing dropped is replayed
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(receiver.reader.read(1), 0.2)
            assert server.stats()["bytes_dropped_no_receiver"] == 6 * MIB
            sender.close()
            receiver.close()
        finally:
            await server.stop()

    run(main)


# ------------------------------------------------------------------ refusals


@pytest.mark.timeout(10)
def test_second_sender_is_refused_and_the_first_goes_on():
    async def main():
        server = await started(make_config())
        try:
            receiver = await connect_reader(server)
            await wait_until(lambda: server.stats()["active_receivers"] == 1, what="receiver")
            _, first = await asyncio.open_connection(HOST, server.sender_port)
            await wait_until(lambda: server.stats()["sender_connected"], what="first sender")

            second_reader, second = await asyncio.open_connection(HOST, server.sender_port)
            try:
                assert await asyncio.wait_for(second_reader.read(1), 3) == b""  # closed at once
            except ConnectionResetError:
                pass
            await wait_until(lambda: server.stats()["senders_refused"] == 1, what="refusal")
            second.write(b"not forwarded")
            first.write(b"from the first")
            await first.drain()
            assert await asyncio.wait_for(receiver.reader.readexactly(14), 3) == b"from the first"
            second.close()

            first.close()  # a new sender may come once the first is gone (docs/design/byte-ring.md §2)
            await wait_until(lambda: not server.stats()["sender_connected"], what="first gone")
            _, third = await asyncio.open_connection(HOST, server.sender_port)
            third.write(b"third")
            await third.drain()
            assert await asyncio.wait_for(receiver.reader.readexactly(5), 3) == b"third"
            stats = server.stats()
            assert stats["sender_connections"] == 2 and stats["senders_refused"] == 1
            third.close()
            receiver.close()
        finally:
            await server.stop()

    run(main)


@pytest.mark.timeout(10)
def test_receivers_beyond_max_are_refused():
    async def main():
        server = await started(make_config(max_receivers=2))
        try:
            readers = [await connect_reader(server) for _ in range(2)]
            await wait_until(lambda: server.stats()["active_receivers"] == 2, what="2 receivers")
            extra = await connect_reader(server)
            try:
                assert await asyncio.wait_for(extra.reader.read(1), 3) == b""
            except ConnectionResetError:
                pass
            stats = server.stats()
            assert stats["receivers_refused"] == 1 and stats["active_receivers"] == 2
            # what receivers send is discarded, and a departure frees a place
            readers[0].writer.write(b"ignored")
            await wait_until(lambda: server.stats()["receiver_bytes_discarded"] == 7, what="discard")
            readers[0].close()
            await wait_until(lambda: server.stats()["active_receivers"] == 1, what="departure")
            again = await connect_reader(server)
            await wait_until(lambda: server.stats()["active_receivers"] == 2, what="a new receiver")
            for r in (readers[1], extra, again):
                r.close()
        finally:
            await server.stop()

    run(main)


# ------------------------------------------------- clogged in-memory transports


class _FakeSenderTransport:
    def __init__(self) -> None:
        self.reading = True
        self.closing = False

    def get_extra_info(self, name, default=None):
        return ("memory", 1) if name == "peername" else default

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close


class _ClogTransport:
    """A receiver transport that keeps references to what it is given, as uvloop's does, and sends
    nothing while clogged."""

    def __init__(self, proto: _ReceiverProtocol) -> None:
        self.proto = proto
        self.held: list[memoryview] = []
        self.out = bytearray()
        self.clogged = True
        self.closing = False

    def get_extra_info(self, name, default=None):
        return ("memory", 2) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        assert high == 0

    def write(self, data) -> None:
        self.held.append(memoryview(data))
        if self.clogged:
            if not self.proto.write_paused:
                self.proto.pause_writing()
        else:
            self._flush()

    def _flush(self) -> None:
        for view in self.held:
            self.out += view
        self.held.clear()

    def unclog(self) -> None:
        self.clogged = False
        self._flush()
        if self.proto.write_paused:
            self.proto.resume_writing()

    def get_write_buffer_size(self) -> int:
        return sum(len(v) for v in self.held)

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True
        self.held.clear()


@pytest.mark.timeout(10)
def test_reads_into_a_full_ring_are_kept_in_order_and_pinned_bytes_are_never_overwritten():
    """uvloop reads a newly connected sender once even if the ring is full (it starts reading after
    connection_made): those bytes wait outside the ring, in order. The clogged receiver holds
    memoryviews of the ring, as uvloop does; they must still hold the right bytes when it drains."""

    async def main():
        cfg = make_config(
            capacity_bytes=256 * KIB,
            soft_lag_bytes=64 * KIB,
            hard_lag_bytes=128 * KIB,
            recv_chunk_bytes=64 * KIB,
            kick_grace_ms=60_000,
        )
        server = await started(cfg)
        try:
            receiver = _ReceiverProtocol(server)
            clog = _ClogTransport(receiver)
            receiver.connection_made(clog)
            sender = _SenderProtocol(server)
            sender_transport = _FakeSenderTransport()
            sender.connection_made(sender_transport)
            produced = bytearray()
            counter = 0
            spilled = False
            for _ in range(40):  # keep "reading" past the pause, as the race does
                buf = sender.get_buffer(-1)
                n = min(len(buf), 50_000)
                chunk = bytes((counter + i) % 253 for i in range(n))
                counter += n
                buf[:n] = chunk
                produced += chunk
                sender.buffer_updated(n)
                await asyncio.sleep(0)  # let the pump hand ring memory to the clogged transport
                spilled = spilled or server.stats()["pending_sender_bytes"] > 0
            assert spilled
            stats = server.stats()
            assert stats["paused"] and not sender_transport.reading
            assert stats["ring_buffer_used"] == cfg.capacity_bytes
            assert stats["bytes_received"] + stats["pending_sender_bytes"] == len(produced)
            clog.unclog()
            await wait_until(lambda: len(clog.out) == len(produced), what="everything delivered")
            assert bytes(clog.out) == bytes(produced)
            assert sender_transport.reading and not server.stats()["paused"]
        finally:
            await server.stop()

    run(main)
