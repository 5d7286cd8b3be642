"""A raw-socket SSE client for gateway tests: HTTP/1.1 head, chunked body, event-stream parsing as a browser's
`EventSource` does it (fields, comments, `lastEventId`), and bounded waits. It reads only when asked, so a
test can leave it unread (a slow consumer)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import orjson


@dataclass
class Event:
    """One dispatched event, or (`comments` only) a block of comment lines such as `: ping`."""

    event: str = "message"
    data: str | None = None
    id: str | None = None
    comments: list[str] = field(default_factory=list)

    def json(self):
        assert self.data is not None, self
        return orjson.loads(self.data)


class SseClient:
    def __init__(self, gw, query: str = "", *, headers: dict | None = None, rcvbuf: int | None = None,
                 path: str = "/sse", read_head: bool = True):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect(("127.0.0.1", gw.http_port))
        lines = [f"GET {path}{query} HTTP/1.1", f"Host: 127.0.0.1:{gw.http_port}", "Accept: text/event-stream"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.raw = b""  # received, not yet decoded (HTTP framing)
        self.body = b""  # decoded body, not yet parsed into events
        self.eof = False  # the peer closed
        self.ended = False  # the response is complete (last chunk, or Content-Length bytes)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.last_event_id = ""  # as a browser keeps it: the last id field seen
        self._pending = Event()
        self._length: int | None = None
        if read_head:
            self.read_head()

    # -- transport ---------------------------------------------------------------------------------------

    def _recv(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; undecoded {self.raw[:200]!r}, body {self.body[:200]!r}"
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            raise AssertionError(f"timed out; body {self.body[-300:]!r}") from None
        if not data:
            self.eof = True
        self.raw += data

    def read_head(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in self.raw:
            assert not self.eof, f"closed before the head: {self.raw!r}"
            self._recv(deadline)
        head, self.raw = self.raw.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for line in header_lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if self.headers.get("transfer-encoding") != "chunked":
            self._length = int(self.headers.get("content-length", "0"))
        self._decode()

    def _decode(self) -> None:
        if self._length is not None:
            take = self.raw[: self._length - len(self.body)]
            self.body += take
            self.raw = self.raw[len(take):]
            self.ended = len(self.body) == self._length
            return
        while not self.ended:
            size_line, sep, rest = self.raw.partition(b"\r\n")
            if not sep:
                return
            size = int(size_line, 16)
            if len(rest) < size + 2:
                return
            assert rest[size:size + 2] == b"\r\n", rest[: size + 2]
            self.body += rest[:size]
            self.raw = rest[size + 2:]
            if size == 0:
                self.ended = True

    def json(self, timeout: float = 5.0):
        """The body of a non-stream answer (an HTTP error), as JSON."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            assert not self.eof, "closed before the end of the body"
            self._recv(deadline)
            self._decode()
        return orjson.loads(self.body)

    # -- events ------------------------------------------------------------------------------------------

    def next_event(self, timeout: float = 5.0) -> Event | None:
        """The next event or comment block; None when the stream ended (nothing more will come)."""
        deadline = time.monotonic() + timeout
        while True:
            line, sep, rest = self.body.partition(b"\n")
            if sep:
                self.body = rest
                event = self._line(line.decode())
                if event is not None:
                    return event
                continue
            if self.ended or self.eof:
                return None
            self._recv(deadline)
            self._decode()

    def _line(self, line: str) -> Event | None:
        pending = self._pending
        if not line:
            self._pending = Event()
            if pending.data is None and not pending.comments:
                return None
            if pending.id is not None:
                self.last_event_id = pending.id
            return pending
        if line.startswith(":"):
            pending.comments.append(line)
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            pending.event = value
        elif name == "data":
            pending.data = value if pending.data is None else pending.data + "\n" + value
        elif name == "id":
            pending.id = value
        return None

    def next_batch(self, timeout: float = 5.0) -> list[dict]:
        """The entries of the next `message` event (comments skipped)."""
        while True:
            event = self.next_event(timeout)
            assert event is not None, "the stream ended"
            if event.data is not None:
                assert event.event == "message", event
                return event.json()

    def collect(self, until, timeout: float = 5.0) -> list[dict]:
        """Entries of `message` events until `until(entries_so_far)`; fail after `timeout` seconds."""
        got: list[dict] = []
        deadline = time.monotonic() + timeout
        while not until(got):
            got += self.next_batch(deadline - time.monotonic())
        return got

    def session(self) -> dict:
        event = self.next_event()
        assert event is not None and event.event == "session", event
        return event.json()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "SseClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def msgs(entries, topic=None):
    return [e for e in entries if e["type"] == "msg" and (topic is None or e["topic"] == topic)]
