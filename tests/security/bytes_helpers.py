"""Peers that misbehave at the byte level, for the tests of issue 24 (tests/security/test_bytes_*.py): a raw
WebSocket client that frames by hand (pings, fragments) and may never read; plain connections read until the
gateway closes them, and its connection counters (tests/security/test_edge_http.py, test_connection_limits.py)."""

from __future__ import annotations

import base64
import os
import socket
import struct
import time

from loadtest.floodprobe import ws_frame  # noqa: F401 - the tests' frames

TEXT, CONT, CLOSE, PING = 0x1, 0x0, 0x8, 0x9


def tcp(gw) -> socket.socket:
    """A plain connection to the gateway's HTTP port."""
    return socket.create_connection(("127.0.0.1", gw.http_port), timeout=5)


def open_connections(gw) -> int:
    return gw.call(lambda: gw.hub.limiter.open)


def refused(gw) -> dict[str, int]:
    return gw.call(lambda: dict(gw.hub.limiter.refused))


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the gateway sends until it closes the connection; fails if it is still open after `timeout`."""
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"still open after {timeout} s; got {data[:300]!r}"
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


class RawWs:
    """A WebSocket client on a bare socket: it reads only when told to (a small receive buffer, so a peer
    that does not read fills it at once)."""

    def __init__(
        self, port: int, *, rcvbuf: int = 4096, query: str = "", path: str = "/ws", subprotocol: str | None = None
    ) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        offer = f"Sec-WebSocket-Protocol: {subprotocol}\r\n" if subprotocol else ""
        sock.sendall(
            (
                f"GET {path}{query} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{offer}\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            assert chunk, "closed during the handshake"
            head += chunk
        assert head.startswith(b"HTTP/1.1 101"), head
        self.sock = sock
        self.buffer = b""

    def send(self, data: bytes, timeout: float = 5.0) -> bool:
        """Send all of `data`; False when the peer stopped reading for `timeout` seconds (or closed)."""
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(data)
            return True
        except (socket.timeout, OSError):
            return False

    def flood(self, frame: bytes, seconds: float) -> int:
        """Send `frame` again and again for `seconds` (never reading); returns the bytes the peer took."""
        chunk = frame * max(1, 65536 // len(frame))
        sent = 0
        deadline = time.monotonic() + seconds
        self.sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                sent += self.sock.send(chunk)
            except socket.timeout:
                continue
            except OSError:
                break
        return sent

    def frames(self, timeout: float = 5.0):
        """Read server frames until the connection ends; yields (opcode, payload)."""
        self.sock.settimeout(timeout)
        while True:
            while True:
                parsed = self._parse()
                if parsed is None:
                    break
                yield parsed
            try:
                chunk = self.sock.recv(65536)
            except (socket.timeout, OSError):
                return
            if not chunk:
                return
            self.buffer += chunk

    def close_code(self, timeout: float = 5.0) -> int | None:
        """Read until the server's close frame; its code (None: the connection ended without one)."""
        for opcode, payload in self.frames(timeout):
            if opcode == CLOSE:
                return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        return None

    def _parse(self):
        buf = self.buffer
        if len(buf) < 2:
            return None
        n = buf[1] & 0x7F
        offset = 2
        if n == 126:
            if len(buf) < 4:
                return None
            n = struct.unpack("!H", buf[2:4])[0]
            offset = 4
        elif n == 127:
            if len(buf) < 10:
                return None
            n = struct.unpack("!Q", buf[2:10])[0]
            offset = 10
        if len(buf) < offset + n:
            return None
        self.buffer = buf[offset + n :]
        return buf[0] & 0x0F, buf[offset : offset + n]

    def close(self) -> None:
        self.sock.close()


def only_client(gw, prefix: str = "ws-") -> str:
    return gw.call(lambda: next(c for c in gw.hub.clients.conns if c.startswith(prefix)))
