"""Connection-level defences of the HTTP port: connection limits and the request-header deadline.

One anonymous peer must not exhaust the gateway's file descriptors or hold connections open forever by
never finishing its request headers (slowloris). uvicorn runs `GuardedHttpToolsProtocol`, a subclass of its
httptools protocol: every accepted connection is admitted by the `ConnectionLimiter` before anything is
parsed, or answered with a fixed 503 and closed. An upgraded WebSocket connection keeps its slot: its loss
is reported to the WebSocket protocol only, which releases it (gateway/ws.py).

The protocol also exposes itself in each request's ASGI scope (`scope["extensions"][SCOPE_KEY]`), so that a
streaming response (SSE, gateway/sse.py) can write straight to the transport, as the WebSocket does; such a
response sets itself as `stream` and is told of the transport's flow control and of the connection's loss.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Protocol, cast

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .ratelog import BadInputLog

#: where the protocol puts itself in each request's ASGI scope, under "extensions"
SCOPE_KEY = "fanout.http"

#: reasons a connection is refused or cut, as exported in fanout_connections_refused_total{reason}
REASONS = ("total", "per_ip", "header_timeout")

#: counts and rate-limits refusals of a limiter made without the hub's log (one per process otherwise)
FALLBACK_BAD_INPUT = BadInputLog(5.0)

_REFUSAL_BODY = orjson.dumps({"error": {
    "code": "too_many_connections",
    "message": "too many open connections, in all or from your address; retry later",
}})
#: one fixed answer, pre-built: refusing costs one write whatever the flood, and nothing is parsed first
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: %d\r\n"
    b"Connection: close\r\n\r\n" % len(_REFUSAL_BODY)
) + _REFUSAL_BODY


#: after the answer, a refused peer's request is read and dropped this long at most, or until it closes
#: (RFC 9112 §9.6): closing with its request unread would reset the connection, and over a real network a
#: reset can destroy the 503 before the client reads it
REFUSAL_LINGER_S = 1.0


def peer_ip(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else ""


class ConnectionLimiter:
    """Open connections, in all and per peer IP address (0: no limit), and refusals by reason."""

    def __init__(self, max_total: int = 0, max_per_ip: int = 0, bad_input: BadInputLog | None = None) -> None:
        self.max_total = max_total
        self.max_per_ip = max_per_ip
        self.bad_input = bad_input if bad_input is not None else FALLBACK_BAD_INPUT
        #: admitted transport -> its peer IP, so a release needs no address lookup and counts only once
        self._open: dict[asyncio.BaseTransport, str] = {}
        self.per_ip: Counter[str] = Counter()
        self.refused: Counter[str] = Counter({reason: 0 for reason in REASONS})

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Count the connection in, or refuse it (counted and reported) when a limit is reached."""
        ip = peer_ip(transport)
        if self.max_total and len(self._open) >= self.max_total:
            self.refuse("total", ip)
            return False
        if self.max_per_ip and self.per_ip[ip] >= self.max_per_ip:
            self.refuse("per_ip", ip)
            return False
        self._open[transport] = ip
        self.per_ip[ip] += 1
        return True

    def release(self, transport: asyncio.BaseTransport) -> None:
        """Count the connection out; a transport never admitted, or already released, is ignored."""
        ip = self._open.pop(transport, None)
        if ip is None:
            return
        left = self.per_ip[ip] - 1
        if left:
            self.per_ip[ip] = left
        else:
            del self.per_ip[ip]

    def refuse(self, reason: str, ip: str) -> None:
        self.refused[reason] += 1
        self.bad_input("http", "connection from %s refused or cut: %s", ip or "?", reason)


class StreamListener(Protocol):
    """A response written straight to the transport (gateway/sse.py)."""

    def on_pause(self) -> None:
        """The transport's buffer went above its high-water mark."""

    def on_resume(self) -> None:
        """It drained below the low-water mark."""

    def on_lost(self) -> None:
        """The connection is gone."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol behind the connection limiter and the request-header deadline.

    The deadline runs from connecting, and on a keep-alive connection from the first byte after a completed
    response, to the end of the request headers; a WebSocket handshake is such a request. One timer per
    connection at most; an idle keep-alive connection is left to uvicorn's timeout_keep_alive.
    """

    limiter: ConnectionLimiter = ConnectionLimiter()
    #: seconds; 0: no deadline
    header_timeout_s = 0.0
    _refused = False
    #: the header deadline; on a refused connection, the end of its linger
    _timer: asyncio.TimerHandle | None = None
    #: the response being written straight to the transport, if any (set and cleared by it)
    stream: StreamListener | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # always a stream
        if not self.limiter.admit(transport):
            self._refused = True
            # not super(): a refused connection is never parsed, served, or known to uvicorn's shutdown
            self.transport = transport
            transport.write(REFUSAL)
            if transport.can_write_eof():
                transport.write_eof()  # the peer's own close then ends it (eof_received returns None)
                self._timer = self.loop.call_later(REFUSAL_LINGER_S, transport.close)
            else:  # TLS: closing runs the TLS shutdown, which reads the peer's input meanwhile
                transport.close()
            return
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        # bytes while no request is in progress start the next request's headers (even bare CRLFs, which
        # the parser skips: they cancel uvicorn's keep-alive timer, so they must not hold the connection)
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_deadline()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        cast(dict[str, Any], self.scope).setdefault("extensions", {})[SCOPE_KEY] = self
        super().on_headers_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stream is not None:
            self.stream.on_pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.stream is not None:
            self.stream.on_resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._refused:
            return
        self.limiter.release(self.transport)
        super().connection_lost(exc)
        if self.stream is not None:
            self.stream.on_lost()

    def _arm_header_deadline(self) -> None:
        if self.header_timeout_s > 0:
            self._timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.limiter.refuse("header_timeout", peer_ip(self.transport))
            self.transport.close()


def http_protocol_class(limiter: ConnectionLimiter, header_timeout_s: float) -> type[GuardedHttpToolsProtocol]:
    attrs = {"limiter": limiter, "header_timeout_s": header_timeout_s}
    return type("ConfiguredGuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attrs)
