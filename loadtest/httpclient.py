"""A small HTTP/1.1 keep-alive client for the long-poll subscribers and the HTTP publishers.

:class:`ResponseParser` is sans-I/O (bytes in, responses out) over h11's framing; :class:`HttpConnection`
runs it under an ``asyncio.Protocol`` with one request in flight at a time. It only speaks what the load
generator needs: ``Content-Length`` and chunked bodies, no TLS, no redirects. A general client (httpx)
costs several times more CPU per request, and a long-poll client makes one request per delivered batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import cast

import h11

from .aio import within

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

    The HTTP/1.1 framing is h11's (``Content-Length``, chunked, bodiless 1xx / 204 / 304 answers). Requests
    written with :meth:`request` are the ones the responses answer; bytes that arrive with no request of ours
    outstanding are read as the response to a plain ``GET``, so the parser also reads a stream of responses
    on its own (pipelined responses, tests). Anything h11 refuses raises :class:`HttpProtocolError`, and the
    parser stays refused.
    """

    def __init__(self) -> None:
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self._head: tuple[int, dict[str, str]] | None = None
        self._body = bytearray()

    def request(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
        """The bytes of a request (its ``Host`` and ``Content-Length`` among ``headers``); its response is the
        next one :meth:`feed` returns. Raises :class:`HttpProtocolError` while a response is still due."""
        conn = self._conn
        try:
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            head = conn.send(h11.Request(method=method, target=target, headers=headers))
            data = conn.send(h11.Data(data=body)) if body else b""
            end = conn.send(h11.EndOfMessage())
        except h11.ProtocolError as exc:
            raise HttpProtocolError(f"cannot send a request now: {exc}") from exc
        return (head or b"") + (data or b"") + (end or b"")

    def feed(self, data: bytes) -> list[HttpResponse]:
        conn = self._conn
        out: list[HttpResponse] = []
        try:
            if data:  # h11 reads b"" as the end of the stream
                conn.receive_data(data)
            while True:
                if conn.our_state is h11.IDLE and conn.their_state is h11.IDLE:
                    if not data:
                        return out
                    # bytes with no request of ours outstanding: the response to a plain GET
                    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "response-parser")]))
                    conn.send(h11.EndOfMessage())
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    return out
                if event is h11.PAUSED:
                    if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                        conn.start_next_cycle()  # another response follows
                        continue
                    return out
                if isinstance(event, h11.Response):
                    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
                    self._head = (event.status_code, headers)
                elif isinstance(event, h11.Data):
                    self._body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    out.append(self._finish())
                # InformationalResponse (1xx) and ConnectionClosed: nothing to hand over
        except h11.ProtocolError as exc:
            raise HttpProtocolError(str(exc)) from exc

    def _finish(self) -> HttpResponse:
        assert self._head is not None
        status, headers = self._head
        body = bytes(self._body)
        self._head = None
        self._body = bytearray()
        return HttpResponse(status, headers, body)


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; :meth:`request` one at a time. Open it with :func:`open_connection`."""

    def __init__(self, host: str, port: int) -> None:
        self.host_header = f"{host}:{port}"
        self.parser = ResponseParser()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[HttpResponse] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)

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

    async def request(
        self, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None, timeout: float | None = None
    ) -> HttpResponse:
        """Send a request and wait for its response. Raises ConnectionError when the connection is gone."""
        if self.closed or self.transport is None:
            raise ConnectionError("connection closed")
        if self.waiter is not None:
            raise RuntimeError("one request at a time on an HttpConnection")
        fields = [("Host", self.host_header), ("Content-Length", str(len(body))), *(headers or {}).items()]
        try:
            data = self.parser.request(method, target, fields, body)
        except HttpProtocolError as exc:  # bytes the server sent unasked: the connection is in no known state
            self._fail(exc)
            self.closed = True
            raise ConnectionError(f"connection unusable: {exc}") from exc
        self.waiter = asyncio.get_running_loop().create_future()
        waiter = self.waiter
        self.transport.write(data)
        try:
            return await (waiter if timeout is None else within(waiter, timeout))
        except (asyncio.TimeoutError, asyncio.CancelledError):
            # the response may still come: this connection is no longer in a known state
            self.waiter = None
            self.closed = True
            self.transport.abort()
            raise

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_connection(host: str, port: int, timeout: float = 10.0, source: str | None = None) -> HttpConnection:
    """A keep-alive connection; ``source``: the local address to connect from (any port)."""
    loop = asyncio.get_running_loop()
    _transport, conn = await within(
        loop.create_connection(lambda: HttpConnection(host, port), host, port, local_addr=(source, 0) if source else None),
        timeout,
    )
    return conn
