"""permessage-deflate on `/ws` (gateway/transports/ws_deflate.py) with a real gateway: what is negotiated, the
frames on the wire (RSV1 set on large frames, clear on small ones, each inflating on its own), one compression
per frame and window whatever the number of clients, the client's window request honoured, compressed
commands inflated, and a deflate bomb refused with 1009 while another client reads on."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from websockets.sync.client import connect

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, metric, send

pytestmark = pytest.mark.timeout(60)

RULES = {"rules": [{"pattern": "*", "anonymous": True}]}
BOOK = {"bids": [[10000 - i, 100 + i] for i in range(40)], "asks": [[10001 + i, 200 + i] for i in range(40)]}


class RawClient:
    """A WebSocket client on a bare socket: it sees each frame's header bits and its payload as sent."""

    def __init__(self, gw: Any, extensions: str | None, *, path: str = "/ws", subprotocol: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", gw.http_port), timeout=5)
        key = base64.b64encode(os.urandom(16)).decode()
        offer = f"Sec-WebSocket-Extensions: {extensions}\r\n" if extensions else ""
        asked = f"Sec-WebSocket-Protocol: {subprotocol}\r\n" if subprotocol else ""
        self.sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{asked}{offer}\r\n"
            ).encode()
        )
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(65536)
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        self.answer = {k.lower(): v for k, _, v in (line.decode().partition(": ") for line in head.split(b"\r\n")[1:])}

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def frame(self) -> tuple[int, bytes]:
        """(first byte, payload) of the next frame."""
        first, second = self._take(2)
        length = second & 0x7F
        if length == 126:
            length = struct.unpack("!H", self._take(2))[0]
        elif length == 127:
            length = struct.unpack("!Q", self._take(8))[0]
        return first, self._take(length)

    def send(self, payload: bytes, *, compressed: bool = False, opcode: int = 0x1) -> None:
        mask = os.urandom(4)
        first = 0x80 | opcode | (0x40 if compressed else 0)
        n = len(payload)
        head = (
            bytes((first, 0x80 | n))
            if n < 126
            else (struct.pack("!BBH", first, 0xFE, n) if n < 65536 else struct.pack("!BBQ", first, 0xFF, n))
        )
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def close(self) -> None:
        self.sock.close()


def inflate(payload: bytes, window_bits: int = 15) -> bytes:
    """One message on its own, as a client with no context takeover inflates it."""
    return zlib.decompressobj(-window_bits).decompress(payload + b"\x00\x00\xff\xff")


def compressed(data: bytes) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return body[:-4]


def publish(gw: Any, topic: str, data: Any) -> None:
    reply = web.post(f"{gw.http_url}/api/topics/{topic}/publish", json={"data": data}, headers=auth(gw))
    assert reply.status_code == 200, reply.text


def subscribe_raw(client: RawClient, topic: str) -> None:
    client.send(orjson.dumps({"op": "subscribe", "topic": topic, "id": 1}))
    _, payload = client.frame()  # `subscribed`: small, never compressed
    assert orjson.loads(payload)[0]["type"] == "subscribed"


@pytest.fixture(scope="module")
def gw() -> Iterator[Any]:
    """One gateway of RULES for the module: each test on topics of its own (metrics compared as differences)."""
    with run_gateway(topics=RULES) as handle:
        yield handle


def test_negotiation_is_without_context_takeover_and_off_declines_it(gw) -> None:
    client = RawClient(gw, "permessage-deflate; client_max_window_bits")
    answer = client.answer["sec-websocket-extensions"]
    assert "server_no_context_takeover" in answer and "client_no_context_takeover" in answer
    client.close()
    assert "sec-websocket-extensions" not in RawClient(gw, None).answer
    with run_gateway(topics=RULES, websocket={"compression": "off"}) as off:
        assert "sec-websocket-extensions" not in RawClient(off, "permessage-deflate").answer


def test_one_compression_per_frame_for_every_client_and_small_frames_go_plain(gw) -> None:
    clients = [RawClient(gw, "permessage-deflate") for _ in range(3)]
    plain = RawClient(gw, None)
    for client in (*clients, plain):
        subscribe_raw(client, "book")
    before = metric(gw, "fanout_ws_deflated_frames_total")
    # the counters are the process's (another test's gateway may have run in it): compared as differences
    wire_before = metric(gw, "fanout_ws_wire_bytes_total")
    payload_before = metric(gw, "fanout_ws_payload_bytes_total")
    publish(gw, "book", BOOK)
    first, expected = plain.frame()
    assert first == 0x81
    payloads = []
    for client in clients:
        first, payload = client.frame()
        assert first == 0xC1  # FIN, RSV1, text
        assert inflate(payload) == expected
        payloads.append(payload)
    assert len(set(payloads)) == 1 and len(payloads[0]) < len(expected) / 2
    assert metric(gw, "fanout_ws_deflated_frames_total") == before + 1  # once for the three
    publish(gw, "book", {"p": 1})  # below compression_min_bytes: as it is, RSV1 clear
    for client in clients:
        first, payload = client.frame()
        assert first == 0x81 and orjson.loads(payload)[0]["data"] == {"p": 1}
    assert metric(gw, "fanout_ws_wire_bytes_total") - wire_before < metric(gw, "fanout_ws_payload_bytes_total") - payload_before


def test_the_clients_window_request_is_honoured(gw) -> None:
    small = RawClient(gw, "permessage-deflate; server_max_window_bits=10")
    assert "server_max_window_bits=10" in small.answer["sec-websocket-extensions"]
    large = RawClient(gw, "permessage-deflate")
    for client in (small, large):
        subscribe_raw(client, "w")
    data = {"text": "abcdefgh" * 300, "n": list(range(200))}
    publish(gw, "w", data)
    _, narrow = small.frame()
    _, wide = large.frame()
    assert orjson.loads(inflate(narrow, 10))[0]["data"] == data
    assert orjson.loads(inflate(wide))[0]["data"] == data


def test_compressed_commands_are_inflated(gw) -> None:
    with connect(gw.ws_url, compression="deflate", open_timeout=5) as ws:
        for i in range(3):  # each compressed on its own (the gateway asked for no context takeover)
            ws.send(json.dumps({"op": "rpc", "method": "whoami", "id": i, "params": {"pad": "x" * 5000}}))
            reply = orjson.loads(ws.recv(timeout=5))[0]
            assert reply["id"] == i and reply["type"] in ("reply", "error")


def test_a_deflate_bomb_is_refused_with_1009_and_disturbs_nobody(gw) -> None:
    with connect(gw.ws_url, compression="deflate", open_timeout=5) as other:
        send(other, op="subscribe", topic="calm", id=1)
        other.recv(timeout=5)
        bomber = RawClient(gw, "permessage-deflate")
        bomb = compressed(b"[" + b" " * (16 << 20) + b"]")  # 16 MiB of JSON in ~16 KiB
        assert len(bomb) < 60_000
        bomber.send(bomb, compressed=True)  # under max_frame_bytes on the wire, far over it inflated
        first, payload = bomber.frame()
        assert first == 0x88 and struct.unpack("!H", payload[:2])[0] == 1009
        publish(gw, "calm", {"still": "here"})
        assert orjson.loads(other.recv(timeout=5))[0]["data"] == {"still": "here"}
