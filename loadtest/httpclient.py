"""A small HTTP/1.1 keep-alive client for the long-poll subscribers and the HTTP publishers.

:class:`ResponseParser` is sans-I/O (bytes in, responses out); :class:`HttpConnection` runs it under an
``asyncio.Protocol`` with one request in flight at a time. It only speaks what the load generator needs:
``Content-Length`` and chunked bodies, no TLS, no redirects. A general client (httpx) costs several times
more CPU per request, and a long-poll client makes one request per delivered batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

#: a response head longer than this is not from a server we talk to
MAX_HEAD = 64 * 1024


class HttpProtocolError(ValueError):
    """The server sent something that is not HTTP/1.1 as we know it."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    #: time.time_ns() when the last byte of the response arrived
    recv_ns: int = 0


class ResponseParser:
    """Feed bytes with :meth:`feed`; it returns the responses completed by them (maybe several, maybe none).

    ``head_only`` answers (HEAD requests, 1xx, 204, 304) are not supported: we never send such requests.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head: tuple[int, dict[str, str]] | None = None
        self._remaining = 0  # bytes of the current fixed-length body or chunk
        self._chunked = False
        self._chunk_state = "size"  # size | data | crlf | trailer
        self._body = bytearray()

    def feed(self, data: bytes) -> list[HttpResponse]:
        self._buf += data
        out: list[HttpResponse] = []
        while True:
            response = self._step()
            if response is None:
                return out
            out.append(response)

    def _step(self) -> HttpResponse | None:
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise HttpProtocolError("response head too long")
                return None
            self._head = self._parse_head(bytes(self._buf[:end]))
            del self._buf[:end + 4]
            headers = self._head[1]
            self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            self._chunk_state = "size"
            if not self._chunked:
                length = headers.get("content-length", "0")
                if not (length.isascii() and length.isdigit()):
                    raise HttpProtocolError("bad content-length")
                self._remaining = int(length)
        if self._chunked:
            return self._step_chunked()
        if len(self._buf) < self._remaining:
            return None
        body = bytes(self._buf[:self._remaining])
        del self._buf[:self._remaining]
        return self._finish(body)

    def _step_chunked(self) -> HttpResponse | None:
        while True:
            if self._chunk_state == "size":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return None
                digits = bytes(self._buf[:end]).split(b";")[0].strip()
                if not digits or digits.strip(b"0123456789abcdefABCDEF"):
                    raise HttpProtocolError("bad chunk size")
                size = int(digits, 16)
                del self._buf[:end + 2]
                self._remaining = size
                self._chunk_state = "data" if size else "trailer"
            elif self._chunk_state == "data":
                if len(self._buf) < self._remaining + 2:
                    return None
                self._body += self._buf[:self._remaining]
                del self._buf[:self._remaining + 2]
                self._chunk_state = "size"
            else:  # trailer: lines until an empty one
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return None
                del self._buf[:end + 2]
                if end == 0:
                    body = bytes(self._body)
                    self._body = bytearray()
                    return self._finish(body)

    def _finish(self, body: bytes) -> HttpResponse:
        assert self._head is not None
        status, headers = self._head
        self._head = None
        return HttpResponse(status, headers, body)

    @staticmethod
    def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isascii() and parts[1].isdigit()):
            raise HttpProtocolError(f"bad status line {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise HttpProtocolError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; :meth:`request` one at a time. Open it with :func:`open_connection`."""

    def __init__(self, host: str, port: int) -> None:
        self.host_header = f"{host}:{port}".encode()
        self.parser = ResponseParser()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[HttpResponse] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop transports are not asyncio.Transport subclasses)

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        try:
            responses = self.parser.feed(data)
        except HttpProtocolError as exc:
            self._fail(exc)
            return
        for response in responses:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(HttpResponse(response.status, response.headers, response.body, now))
            self.waiter = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.waiter = None
        if self.transport is not None:
            self.transport.abort()

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, timeout: float | None = None) -> HttpResponse:
        """Send a request and wait for its response. Raises ConnectionError when the connection is gone."""
        if self.closed or self.transport is None:
            raise ConnectionError("connection closed")
        if self.waiter is not None:
            raise RuntimeError("one request at a time on an HttpConnection")
        head = [f"{method} {target} HTTP/1.1".encode(), b"Host: " + self.host_header,
                b"Content-Length: " + str(len(body)).encode()]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}".encode())
        self.waiter = asyncio.get_running_loop().create_future()
        waiter = self.waiter
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        try:
            return await (waiter if timeout is None else asyncio.wait_for(waiter, timeout))
        except (asyncio.TimeoutError, asyncio.CancelledError):
            # the response may still come: this connection is no longer in a known state
            self.waiter = None
            self.closed = True
            self.transport.abort()
            raise

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_connection(host: str, port: int, timeout: float = 10.0) -> HttpConnection:
    loop = asyncio.get_running_loop()
    _transport, conn = await asyncio.wait_for(
        loop.create_connection(lambda: HttpConnection(host, port), host, port), timeout)
    return conn
