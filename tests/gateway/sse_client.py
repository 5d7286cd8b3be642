"""A raw-socket SSE client for gateway tests: HTTP/1.1 through h11 (head, chunked or Content-Length body),
event-stream parsing as a browser's `EventSource` does it (fields, comments, `lastEventId`), and bounded waits.
It reads only when asked, so a test can leave it unread (a slow consumer)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import h11
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
    def __init__(
        self,
        gw,
        query: str = "",
        *,
        headers: dict | None = None,
        rcvbuf: int | None = None,
        path: str = "/sse",
        read_head: bool = True,
    ):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect(("127.0.0.1", gw.http_port))
        self._http = h11.Connection(h11.CLIENT)
        fields = [("Host", f"127.0.0.1:{gw.http_port}"), ("Accept", "text/event-stream")]
        fields += [(name, value) for name, value in (headers or {}).items()]
        request = self._http.send(h11.Request(method="GET", target=f"{path}{query}", headers=fields))
        self.sock.sendall(request + self._http.send(h11.EndOfMessage()))
        self.body = b""  # decoded body, not yet parsed into events
        self.eof = False  # the peer closed
        self.ended = False  # the response is complete (last chunk, or Content-Length bytes)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.last_event_id = ""  # as a browser keeps it: the last id field seen
        self._pending = Event()
        if read_head:
            self.read_head()

    # -- transport ---------------------------------------------------------------------------------------

    @property
    def raw(self) -> bytes:
        """Received, not yet decoded (HTTP framing)."""
        return self._http.trailing_data[0]

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
        self._http.receive_data(data)  # b"": the end of the stream

    def read_head(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.status:
            self._decode()
            if self.status:
                break
            assert not self.eof, f"closed before the head: {self.raw!r}"
            self._recv(deadline)

    def _decode(self) -> None:
        """Hand over what h11 can make of the bytes received: the head, then body bytes, then the end."""
        while not self.ended:
            try:
                event = self._http.next_event()
            except h11.RemoteProtocolError as exc:
                if self.eof:
                    return  # closed early: what came is kept, nothing more will (the callers say what was missing)
                raise AssertionError(f"not HTTP/1.1 as h11 knows it: {exc}; undecoded {self.raw[:200]!r}") from None
            if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Response):
                self.status = event.status_code
                for name, value in event.headers:
                    self.headers[name.decode("latin-1")] = value.decode("latin-1")
            elif isinstance(event, h11.Data):
                self.body += event.data
            elif isinstance(event, h11.EndOfMessage):
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
