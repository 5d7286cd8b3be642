"""Clients for gateway tests: real sockets on loopback, bounded waits."""

from __future__ import annotations

import json
import socket
import time

import msgspec
import orjson
from websockets.sync.client import connect

from fanout_client.ingest import BadAnswer, Closed, IngestConnection


def ws_connect(gw, *, query: str = "", rcvbuf: int | None = None, max_queue: int | None = None):
    sock = None
    if rcvbuf is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", gw.http_port))
    # max_queue=None (unbounded): a test that stops reading must not stall the close handshake for 10 s;
    # a client meant to stall passes a bound, so its reader stops and the kernel buffers fill. Its close
    # handshake then waits behind the unread frames (the gateway may have cut it long before): 1 s, not 10
    return connect(gw.ws_url + query, sock=sock, open_timeout=5, max_size=None, max_queue=max_queue,
                   compression=None, close_timeout=10 if max_queue is None else 1)


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


def wait_for(predicate, what: str = "condition", timeout: float = 10.0):
    """The first true value of `predicate()`, tried every 50 ms; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def auth(gw) -> dict:
    return {"Authorization": f"Bearer {gw.admin_token}"}


class Ingest:
    """A TCP ingest publisher (fanout_client.ingest) whose answers are dicts, as the tests compare them."""

    def __init__(self, gw):
        self.connection = IngestConnection("127.0.0.1", gw.ingest_port, timeout=5)

    def send(self, *records) -> None:
        self.connection.send(*records)

    def send_raw(self, data: bytes) -> None:
        self.connection.write(data)

    def has_line(self, timeout: float) -> bool:
        """Whether an answer arrives within `timeout` seconds (without consuming it)."""
        return self.connection.poll(timeout)

    def readline(self) -> dict:
        answer = self.connection.next_answer()
        assert not isinstance(answer, (Closed, BadAnswer)), f"no answer: {answer!r}"
        return msgspec.to_builtins(answer)

    def sync(self, sync_id=1) -> dict:
        """The `synced` answer; error answers before it are skipped (kept in `connection.errors`)."""
        return msgspec.to_builtins(self.connection.sync(sync_id))

    def close(self):
        self.connection.close()
