"""`WebSocketProtocol` driven over `socket.socketpair()`, no server and no port (websockets' own
tests/asyncio do it so): a real hub (in-process broker, its scheduler and sessions), the protocol made by
`protocol_class` on one end, websockets' sans-I/O client on the other. Keepalive, fragments, permessage-
deflate, the close codes of a misbehaving peer, the write pause, and the connection's state (ws_state.py).

A Unix socket pair has no TCP options: `websocket.notsent_lowat_bytes` is 0 here (TCP_NOTSENT_LOWAT would be
refused), and the keepalive never sees the peer's ACKs (TCP_INFO), so a ping that falls due is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from gateway import close_codes
from gateway.config import load_config
from gateway.edge.netguard import ConnectionLimiter
from gateway.edge.origin import OriginPolicy
from gateway.hub import Hub
from gateway.testing import DEFAULTS
from gateway.transports.staging import StagedWriter
from gateway.transports.ws import WebSocketProtocol, protocol_class, ws_counters
from gateway.transports.ws_state import IllegalMove, WSState, checked_move

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

#: what each wait may take at most before the test fails (a condition is awaited, never a fixed time)
WAIT_S = 5.0
#: the socket pair's options: no TCP here
UNIX_SOCKET = {"notsent_lowat_bytes": 0}


def _config(websocket: dict[str, Any]) -> Any:
    overrides = {**DEFAULTS, "websocket": {**UNIX_SOCKET, **websocket}}
    return load_config(overrides=overrides, environ={})


@contextlib.asynccontextmanager
async def served(**websocket: Any) -> AsyncIterator[type[WebSocketProtocol]]:
    """The protocol class of one server over a started hub: what uvicorn would instantiate per connection."""
    hub = Hub(_config(websocket))
    await hub.start()
    try:
        yield protocol_class(hub.services, ConnectionLimiter(), OriginPolicy(frozenset()), hub.bad_input)
    finally:
        await hub.stop()


async def until(condition: Callable[[], object], what: str) -> None:
    """Let the loop run until `condition()` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not condition():
        assert loop.time() < deadline, f"not within {WAIT_S} s: {what}"
        await asyncio.sleep(0.005)


class Peer:
    """The client end of the pair: websockets' sans-I/O client, written and read by hand, so a test decides
    what it answers (its pongs and close echo wait in `client.data_to_send()` until `flush`)."""

    def __init__(
        self, client: ClientProtocol, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: WebSocketProtocol
    ) -> None:
        self.client = client
        self.reader = reader
        self.writer = writer
        #: the server's end, to look at (never driven from here)
        self.proto = proto
        self.frames: list[Frame] = []
        self.response: Response | None = None

    def flush(self) -> None:
        """Write what the client queued (frames sent, pongs, the close echo)."""
        for data in self.client.data_to_send():
            if data:
                self.writer.write(data)

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def _read(self) -> bool:
        data = await asyncio.wait_for(self.reader.read(65536), WAIT_S)
        if not data:
            self.client.receive_eof()
            return False
        self.client.receive_data(data)
        for event in self.client.events_received():
            if isinstance(event, Response):
                self.response = event
            elif isinstance(event, Frame):
                self.frames.append(event)
        return True

    async def handshake(self) -> Response:
        while self.response is None:
            assert await self._read(), "closed during the handshake"
        return self.response

    async def frame(self, *opcodes: Opcode) -> Frame:
        """The next frame the server sent of these opcodes (the others are skipped)."""
        while True:
            while not self.frames:
                assert await self._read(), "closed with no such frame"
            frame = self.frames.pop(0)
            if frame.opcode in opcodes:
                return frame

    async def message(self) -> list[dict[str, Any]]:
        """The entries of the next text frame (a JSON array of them, or one object)."""
        frame = await self.frame(Opcode.TEXT)
        decoded = json.loads(bytes(frame.data))
        return decoded if isinstance(decoded, list) else [decoded]

    async def entry(self, type_: str) -> dict[str, Any]:
        while True:
            for entry in await self.message():
                if entry.get("type") == type_:
                    return entry

    async def close_frame(self) -> tuple[int, str]:
        """The code and reason of the server's close frame."""
        frame = await self.frame(Opcode.CLOSE)
        data = bytes(frame.data)
        code = struct.unpack("!H", data[:2])[0]
        return code, data[2:].decode()

    async def closed(self) -> None:
        """Read to the server's end of the stream (its close lingers until ours: echo it)."""
        self.flush()
        while await self._read():
            self.flush()


@contextlib.asynccontextmanager
async def connected(
    cls: type[WebSocketProtocol], path: str = "/ws", *, deflate: bool = False, open_: bool = True
) -> AsyncIterator[Peer]:
    """A connection over a socket pair: the server's end made by asyncio with `cls`, as uvicorn would hand it
    over; the client's request written, and (`open_`) its 101 read."""
    loop = asyncio.get_running_loop()
    server_sock, client_sock = socket.socketpair()
    _, proto = await loop.connect_accepted_socket(cls, server_sock)
    reader, writer = await asyncio.open_connection(sock=client_sock)
    extensions = [ClientPerMessageDeflateFactory(client_max_window_bits=True)] if deflate else None
    client = ClientProtocol(parse_uri(f"ws://gateway.test{path}"), extensions=extensions, max_size=None)
    peer = Peer(client, reader, writer, proto)
    client.send_request(client.connect())
    peer.flush()
    try:
        if open_:
            response = await peer.handshake()
            assert response.status_code == 101, response
        yield peer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        await until(lambda: proto.state is WSState.CLOSED, "the server's end lost")


def subscribe(peer: Peer, topic: str) -> None:
    peer.client.send_text(json.dumps({"op": "subscribe", "topic": topic, "id": 1}).encode())
    peer.flush()


def masked(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, mask: bool = True) -> bytes:
    """One client frame by hand (what websockets' client would refuse to write)."""
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    size = len(payload)
    length = bytes([size]) if size < 126 else b"\x7e" + struct.pack("!H", size)
    if not mask:
        return head + length + payload
    key = b"\x01\x02\x03\x04"
    return head + bytes([length[0] | 0x80]) + length[1:] + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def run(test: Callable[[], Any]) -> None:
    asyncio.run(test())


# -- the state value -------------------------------------------------------------------------------------------


def test_the_state_table_allows_the_connections_moves_and_refuses_the_others() -> None:
    life = [WSState.HANDSHAKE, WSState.AWAITING_HOOK, WSState.OPEN, WSState.CLOSING, WSState.CLOSED]
    for old, new in zip(life, life[1:]):
        assert checked_move(old, new) is new
    assert checked_move(WSState.HANDSHAKE, WSState.OPEN) is WSState.OPEN  # no connect hook to ask
    for old in life[:-1]:
        assert checked_move(old, WSState.CLOSED) is WSState.CLOSED  # lost in any state
    for old, new in [
        (WSState.OPEN, WSState.HANDSHAKE),
        (WSState.CLOSING, WSState.OPEN),
        (WSState.CLOSED, WSState.CLOSED),
        (WSState.OPEN, WSState.AWAITING_HOOK),
        (WSState.CLOSING, WSState.CLOSING),
    ]:
        with pytest.raises(IllegalMove, match=f"from {old.value} to {new.value}"):
            checked_move(old, new)


def test_an_open_connection_goes_closing_then_closed_and_refuses_to_open_again() -> None:
    async def test() -> None:
        async with served() as cls, connected(cls) as peer:
            proto = peer.proto
            assert proto.state is WSState.OPEN and proto.handshake is None
            subscribe(peer, "sp.state")
            await peer.entry("subscribed")
            connection = proto.connection
            assert connection is not None and connection.sink.open
            with pytest.raises(IllegalMove):
                proto.move(WSState.AWAITING_HOOK)
            assert proto.state is WSState.OPEN  # a refused move changes nothing
            proto.close_with(close_codes.GOING_AWAY, "bye")
            assert proto.state is WSState.CLOSING and not connection.sink.open  # not even a crowd's frame
            assert await peer.close_frame() == (close_codes.GOING_AWAY, "bye")
            proto.close_with(close_codes.INTERNAL_ERROR, "again")  # closing already: nothing more written
            await peer.closed()
            await until(lambda: proto.state is WSState.CLOSED, "lost")
            assert not [f for f in peer.frames if f.opcode is Opcode.CLOSE]

    run(test)


def test_a_request_for_another_path_is_answered_404_and_closed_before_any_upgrade() -> None:
    async def test() -> None:
        async with served() as cls, connected(cls, "/nowhere", open_=False) as peer:
            await until(lambda: peer.proto.state is not WSState.HANDSHAKE, "answered")
            assert peer.proto.state in (WSState.CLOSING, WSState.CLOSED) and peer.proto.handshake is None
            data = await asyncio.wait_for(peer.reader.read(), WAIT_S)  # to the end of the stream
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404")
            assert json.loads(body)["error"]["code"] == "not_found"

    run(test)


def test_a_refused_token_gets_the_101_then_its_close_code() -> None:
    async def test() -> None:
        async with served() as cls, connected(cls, "/ws?token=not-a-jwt") as peer:
            code, reason = await peer.close_frame()
            assert code == close_codes.BAD_TOKEN and reason
            assert peer.proto.connection is None  # never registered
            await peer.closed()

    run(test)


# -- messages --------------------------------------------------------------------------------------------------


def test_a_fragmented_command_is_one_message() -> None:
    async def test() -> None:
        async with served() as cls, connected(cls) as peer:
            command = json.dumps({"op": "subscribe", "topic": "sp.frag", "id": 7}).encode()
            client = peer.client
            client.send_text(command[:5], fin=False)
            peer.flush()
            await until(lambda: peer.proto.message is not None, "the first fragment held")
            client.send_continuation(command[5:12], fin=False)
            client.send_continuation(command[12:], fin=True)
            peer.flush()
            entry = await peer.entry("subscribed")
            assert entry["topic"] == "sp.frag"
            await until(lambda: peer.proto.ws is None, "the parser parked once the message ended")

    run(test)


def test_more_fragments_than_allowed_close_with_1008() -> None:
    async def test() -> None:
        async with served(max_fragments=4) as cls, connected(cls) as peer:
            before = ws_counters.fragment_closes
            peer.client.send_text(b"[", fin=False)
            for _ in range(4):
                peer.client.send_continuation(b" ", fin=False)
            peer.flush()
            assert await peer.close_frame() == (
                close_codes.POLICY_VIOLATION,
                "more than 4 fragments in one message (websocket.max_fragments)",
            )
            assert ws_counters.fragment_closes == before + 1
            await peer.closed()

    run(test)


def test_permessage_deflate_compresses_both_ways() -> None:
    async def test() -> None:
        async with served() as cls, connected(cls, deflate=True) as peer:
            assert peer.proto.window_bits > 0
            assert "permessage-deflate" in peer.client.extensions[0].name
            subscribe(peer, "sp.deflate")  # compressed by the client (RSV1), inflated by the server's parser
            await peer.entry("subscribed")
            payload, wire = ws_counters.payload_bytes, ws_counters.wire_bytes
            services = type(peer.proto).service.services
            services.catalog.publish_nowait("sp.deflate", {"text": "x" * 400})
            entry = await peer.entry("msg")  # websockets' client inflated it
            assert entry["data"] == {"text": "x" * 400}
            assert ws_counters.wire_bytes - wire < (ws_counters.payload_bytes - payload) / 4

    run(test)


# -- close codes of a misbehaving peer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (masked(0x1, b"\xff\xfe not UTF-8"), close_codes.INVALID_DATA),
        (masked(0x1, b"x" * 300, mask=False), close_codes.PROTOCOL_ERROR),  # a client frame must be masked
        (masked(0x1, b"x", rsv=0x20), close_codes.PROTOCOL_ERROR),  # RSV2: no extension defines it
        (masked(0x0, b"x"), close_codes.PROTOCOL_ERROR),  # a continuation with no message begun
        (masked(0x9, b"p", fin=False), close_codes.PROTOCOL_ERROR),  # a fragmented ping
    ],
    ids=["bad-utf8", "unmasked", "rsv2", "lone-continuation", "fragmented-ping"],
)
def test_a_peers_protocol_error_closes_with_its_code(frame: bytes, code: int) -> None:
    async def test() -> None:
        async with served() as cls, connected(cls) as peer:
            peer.send_raw(frame)
            assert (await peer.close_frame())[0] == code
            assert peer.proto.state is WSState.CLOSING
            await peer.closed()

    run(test)


def test_a_frame_over_max_frame_bytes_closes_with_1009() -> None:
    async def test() -> None:
        async with served(max_frame_bytes=1024) as cls, connected(cls) as peer:
            peer.send_raw(masked(0x1, b"x" * 2000))
            assert (await peer.close_frame())[0] == close_codes.MESSAGE_TOO_BIG
            await peer.closed()

    run(test)


def test_the_peers_close_is_echoed_with_its_code() -> None:
    async def test() -> None:
        async with served() as cls, connected(cls) as peer:
            peer.client.send_close(1000, "done")  # a normal closure
            peer.flush()
            assert await peer.close_frame() == (1000, "done")
            await until(lambda: peer.proto.state is not WSState.OPEN, "closing")
            await peer.closed()

    run(test)


# -- keepalive -------------------------------------------------------------------------------------------------


def test_a_peer_that_answers_pings_is_pinged_again_and_stays() -> None:
    async def test() -> None:
        async with served(ping_interval_s=0.1, ping_timeout_s=0.5) as cls, connected(cls) as peer:
            payloads = []
            for _ in range(3):
                ping = await peer.frame(Opcode.PING, Opcode.CLOSE)
                assert ping.opcode is Opcode.PING
                payloads.append(bytes(ping.data))
                peer.flush()  # websockets' client queued the pong
            assert len(set(payloads)) == 3  # each ping its own payload, so a stale pong is ignored
            assert peer.proto.state is WSState.OPEN

    run(test)


def test_a_peer_that_does_not_answer_is_closed_with_1011() -> None:
    async def test() -> None:
        async with served(ping_interval_s=0.1, ping_timeout_s=0.1) as cls, connected(cls) as peer:
            await peer.frame(Opcode.PING)
            peer.client.data_to_send()  # the pong is never written
            assert await peer.close_frame() == (close_codes.INTERNAL_ERROR, "keepalive ping timeout")
            assert peer.proto.state is WSState.CLOSING
            await peer.closed()

    run(test)


# -- the write pause ---------------------------------------------------------------------------------------


def test_one_write_pause_flag_holds_the_latest_pong_until_the_peer_reads() -> None:
    async def test() -> None:
        async with served(write_high_water=1024) as cls, connected(cls) as peer:
            proto = peer.proto
            subscribe(peer, "sp.pause")
            await peer.entry("subscribed")
            connection = proto.connection
            assert isinstance(connection, StagedWriter) and connection.pause is proto  # read there, kept here
            coalesced = ws_counters.pongs_coalesced
            sent = 0
            # pings whose pongs the peer does not read: the socket's buffer fills, then the transport's
            while not proto.paused:
                assert sent < 20_000, "never paused"
                for _ in range(64):
                    sent += 1
                    peer.send_raw(masked(0x9, b"%08d" % sent + b"p" * 117))
                await asyncio.sleep(0.001)
            await until(lambda: proto.held_pong is not None, "the latest pong held")
            assert connection.blocked_since is not None  # not ready while paused
            pongs = 0
            while True:  # the peer reads at last: the held pong goes, reading resumes, every ping is answered
                pong = await peer.frame(Opcode.PONG)
                pongs += 1
                if bytes(pong.data).startswith(b"%08d" % sent):
                    break
            # while paused, only the latest ping's pong waited: every other ping got its own
            assert pongs == sent - (ws_counters.pongs_coalesced - coalesced)
            await until(lambda: not proto.paused and connection.blocked_since is None, "drained")
            assert proto.held_pong is None and proto.state is WSState.OPEN

    run(test)
