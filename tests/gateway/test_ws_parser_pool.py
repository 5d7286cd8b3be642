"""The WebSocket protocol's frame parser: an idle connection holds none (it goes back to the server's pool at
a frame boundary, known by reading the frame headers alongside), and frames split anywhere across reads,
fragmented messages and lengths encoded in more bytes than needed all still parse."""

from __future__ import annotations

import struct
import time

import orjson
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode

from gateway.testing import run_gateway
from gateway.transports.ws import WebSocketProtocol
from tests.gateway.gw_helpers import collect, ws_connect


def _pings(ids: range) -> list[bytes]:
    return [orjson.dumps({"op": "ping", "id": i}) for i in ids]


def _masked(opcode: Opcode, payload: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, payload, fin=fin).serialize(mask=True)


def _long_length(payload: bytes) -> bytes:
    """A masked text frame whose length takes 2 bytes though it is under 126: allowed on the wire by
    websockets' parser."""
    mask = b"\x00\x00\x00\x00"
    return struct.pack("!BBH", 0x81, 0x80 | 126, len(payload)) + mask + payload


def _pongs(ws, count: int) -> set[int]:
    got = collect(ws, lambda entries: sum(e.get("result") == "pong" for e in entries) >= count)
    return {e["id"] for e in got if e.get("result") == "pong"}


def _held_parsers(gw) -> list[bool]:
    def census() -> list[bool]:
        return [
            p.ws is not None
            for p in gw.running.server.server_state.connections
            if isinstance(p, WebSocketProtocol) and p.connection is not None
        ]

    return gw.call(census)


def test_frames_split_anywhere_and_fragments_parse_and_an_idle_connection_holds_no_parser():
    with run_gateway() as gw, ws_connect(gw) as ws:
        sock = ws.socket
        first, second, third = _pings(range(1, 4))
        wire = _masked(Opcode.TEXT, first) + _masked(Opcode.TEXT, second)
        for cut in (1, 3, len(wire) // 2):  # inside a header, inside the mask, inside a payload
            sock.sendall(wire[:cut])
            time.sleep(0.05)
            sock.sendall(wire[cut:])
            assert _pongs(ws, 2) == {1, 2}
        parts = [third[:5], third[5:9], third[9:]]  # one message in three frames, three reads
        sock.sendall(_masked(Opcode.TEXT, parts[0], fin=False))
        time.sleep(0.05)
        sock.sendall(_masked(Opcode.CONT, parts[1], fin=False) + _masked(Opcode.PING, b"p"))
        time.sleep(0.05)
        sock.sendall(_masked(Opcode.CONT, parts[2]))
        assert _pongs(ws, 1) == {3}
        assert _held_parsers(gw) == [False]


def test_a_length_in_more_bytes_than_needed_still_parses():
    with run_gateway() as gw, ws_connect(gw) as ws:
        (ping,) = _pings(range(7, 8))
        ws.socket.sendall(_long_length(ping))
        assert _pongs(ws, 1) == {7}
        # the header is read as sent (wsframes.frames_fed): the boundary is found, the parser goes back
        assert _held_parsers(gw) == [False]
        ws.socket.sendall(_masked(Opcode.TEXT, orjson.dumps({"op": "ping", "id": 8})))
        assert _pongs(ws, 1) == {8}


def test_a_refusal_of_ours_after_the_parser_went_back_still_closes_with_its_code():
    """A whole text message leaves the parser at a boundary (back in the pool) before its commands run: its
    invalid UTF-8, seen then, still closes the connection with 1007."""
    with run_gateway() as gw, ws_connect(gw) as ws:
        ws.socket.sendall(_masked(Opcode.TEXT, b'{"op":"ping","id":"\xff"}'))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007


def test_a_connection_that_negotiated_deflate_parks_its_inflating_parser_too():
    """Compressed commands inflate with a pooled parser, which goes back to the pool between reads."""
    from websockets.sync.client import connect

    with run_gateway() as gw, connect(gw.ws_url, compression="deflate", open_timeout=5) as ws:
        for i in range(3):
            echo = {"op": "rpc", "method": "echo", "params": {"pad": "x" * 400}, "id": i}
            ws.send(orjson.dumps(echo).decode())  # compressed by the client
            reply = collect(ws, lambda entries, i=i: any(e.get("id") == i for e in entries))[-1]
            assert reply["type"] == "reply" and reply["result"] == {"pad": "x" * 400}
        assert _held_parsers(gw) == [False]
