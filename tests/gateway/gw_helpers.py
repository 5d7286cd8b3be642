"""Clients for gateway tests: real sockets on loopback, bounded waits."""

from __future__ import annotations

import json
import select
import socket
import time

import orjson
from websockets.sync.client import connect


def ws_connect(gw, *, query: str = "", rcvbuf: int | None = None, max_queue: int | None = None):
    sock = None
    if rcvbuf is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", gw.http_port))
    # max_queue=None (unbounded): a test that stops reading must not stall the close handshake for 10 s;
    # a client meant to stall passes a bound, so its reader stops and the kernel buffers fill
    return connect(gw.ws_url + query, sock=sock, open_timeout=5, max_size=None, max_queue=max_queue,
                   compression=None)


def send(ws, **command) -> None:
    ws.send(json.dumps(command))


def recv_entries(ws, timeout: float = 5.0) -> list[dict]:
    frame = ws.recv(timeout=timeout)
    entries = orjson.loads(frame)
    assert isinstance(entries, list)
    return entries


def collect(ws, until, timeout: float = 5.0) -> list[dict]:
    """Receive entries until `until(entries_so_far)` is true; fail after `timeout` seconds."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; got {got[-5:]}"
        got += recv_entries(ws, remaining)
    return got


def auth(gw) -> dict:
    return {"Authorization": f"Bearer {gw.admin_token}"}


class Ingest:
    """A TCP ingest publisher."""

    def __init__(self, gw):
        self.sock = socket.create_connection(("127.0.0.1", gw.ingest_port), timeout=5)
        self.file = self.sock.makefile("rb")

    def send(self, *records) -> None:
        self.sock.sendall(b"".join(orjson.dumps(r) + b"\n" for r in records))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def has_line(self, timeout: float) -> bool:
        """Whether an answer arrives within `timeout` seconds (without consuming it)."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return bool(ready)

    def readline(self) -> dict:
        line = self.file.readline()
        assert line, "ingest connection closed"
        return orjson.loads(line)

    def sync(self, sync_id=1) -> dict:
        self.send({"sync": sync_id})
        while True:
            answer = self.readline()
            if answer.get("type") == "synced":
                return answer

    def close(self):
        self.file.close()
        self.sock.close()
