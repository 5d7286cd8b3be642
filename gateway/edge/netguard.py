"""Connection-level defences of the HTTP port: connection limits, the request-header deadline, the bounds
of request headers and the `Host` allow-list.

One anonymous peer must not exhaust the gateway's file descriptors or hold connections open forever by
never finishing its request headers (slowloris). uvicorn runs `GuardedHttpToolsProtocol`, a subclass of its
httptools protocol: every accepted connection is admitted by the `ConnectionLimiter` before anything is
parsed, or answered with a fixed 503 and closed. An upgraded WebSocket connection keeps its slot: its loss
is reported to the WebSocket protocol only, which releases it (gateway/transports/ws.py).

Request heads are bounded before they are parsed: httptools joins the pieces of a header value (and uvicorn
those of the URL) by concatenating bytes, so a header sent in many reads costs time quadratic in its size.
The bytes of a head are counted as they arrive and, past `server.max_header_bytes`, the request is answered
`431` without feeding them to the parser; past `server.max_headers` header lines likewise. A request whose
`Host` is not served (gateway/edge/hosts.py) is answered `421`. Each of these answers is one pre-built write, then
the connection is shut and what the peer still sends is dropped unread (as for the 503).

The protocol also exposes itself in each request's ASGI scope (`scope["extensions"][SCOPE_KEY]`), so that a
streaming response (SSE, gateway/transports/sse.py) can write straight to the transport, as the WebSocket does; such a
response sets itself as `stream` and is told of the transport's flow control and of the connection's loss.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any, Protocol, cast

import httptools
import orjson
from prometheus_client.core import GaugeMetricFamily, Metric
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from core.errors import RequestError

from ..errors import BadHost, HeadersTooLarge, TooManyConnections
from ..ops.metrics import counter_family
from .hosts import HostPolicy
from .ratelog import BadInputLog

#: where the protocol puts itself in each request's ASGI scope, under "extensions"
SCOPE_KEY = "fanout.http"

#: reasons a connection is refused or cut, as exported in fanout_connections_refused_total{reason}
REASONS = ("total", "per_ip", "header_timeout", "header_too_large", "bad_host")

#: counts and rate-limits refusals of a limiter made without the hub's log (one per process otherwise)
FALLBACK_BAD_INPUT = BadInputLog(5.0)


def _answer(error: RequestError) -> bytes:
    """A whole HTTP answer for `error`, built once: sending it costs one write, whatever the flood."""
    body = orjson.dumps({"error": {"code": error.code, "message": str(error)}})
    status = HTTPStatus(error.http_status)
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % (status.value, status.phrase.encode(), len(body))
    ) + body


#: a connection past `server.max_connections` or `max_connections_per_ip`: answered before anything is parsed
REFUSAL = _answer(TooManyConnections("too many open connections, in all or from your address; retry later"))
#: request heads over `server.max_header_bytes` or `server.max_headers` (RFC 6585 §5)
HEADERS_TOO_LARGE = _answer(HeadersTooLarge("request headers over server.max_header_bytes or server.max_headers"))
#: a `Host` that is not served here (gateway/edge/hosts.py; RFC 9110 §15.5.20)
BAD_HOST = _answer(BadHost("this Host is not served here (server.allowed_hosts)"))


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing: the request is answered with `answer`."""

    def __init__(self, reason: str, answer: bytes) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answer = answer


def _head_ends(data: bytes, room: int) -> bool:
    """Whether a head may end within the first `room` bytes of `data` (`room` < 0: it may not). A head whose
    end straddles the previous read is let through once: the next read is counted whole again."""
    return room >= 0 and (data.find(b"\r\n\r\n", 0, room + 4) >= 0 or b"\n" in data[:3])


#: after the answer, a refused peer's request is read and dropped this long at most, or until it closes
#: (RFC 9112 §9.6): closing with its request unread would reset the connection, and over a real network a
#: reset can destroy the 503 before the client reads it
REFUSAL_LINGER_S = 1.0
#: ... and at most this many bytes of it: then reading stops (the kernel's buffer and the peer's window
#: hold the rest until the close), so a peer streaming gigabytes into a refused connection costs no CPU here
REFUSAL_DRAIN_BYTES = 256 * 1024


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

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("fanout_http_connections", "open HTTP-port connections (WebSocket included)", value=self.open)
        yield counter_family(
            "fanout_connections_refused",
            "HTTP-port connections refused at a limit or cut at the header deadline",
            "reason",
            self.refused,
        )

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
    """A response written straight to the transport (gateway/transports/sse.py)."""

    def on_pause(self) -> None:
        """The transport's buffer went above its high-water mark."""

    def on_resume(self) -> None:
        """It drained below the low-water mark."""

    def on_lost(self) -> None:
        """The connection is gone."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol behind the connection limiter, the request-header deadline, the bounds
    of request heads and the `Host` allow-list (module docstring).

    The deadline runs from connecting, and on a keep-alive connection from the first byte after a completed
    response, to the end of the request headers; a WebSocket handshake is such a request. One timer per
    connection at most; an idle keep-alive connection is left to uvicorn's timeout_keep_alive.
    """

    limiter: ConnectionLimiter = ConnectionLimiter()
    #: seconds; 0: no deadline
    header_timeout_s = 0.0
    #: bytes of one request head (request line, header lines, the empty line) and header lines in it
    max_header_bytes = 16384
    max_headers = 100
    #: None: every Host is served
    hosts: HostPolicy | None = None
    #: a connection between workers (gateway/workers/forward.py), never one of a client
    internal = False
    _refused = False
    #: answered and shut by us (431, 421): what the peer still sends is dropped
    _answered = False
    #: the parser is between requests or in a head: arriving bytes are counted against max_header_bytes
    _in_head = True
    _head_bytes = 0
    _header_count = 0
    #: bytes read and dropped after our answer (REFUSAL_DRAIN_BYTES)
    _drained = 0
    #: the header deadline; on a refused connection, the end of its linger
    _timer: asyncio.TimerHandle | None = None
    #: the response being written straight to the transport, if any (set and cleared by it)
    stream: StreamListener | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # always a stream
        if not self.limiter.admit(transport):
            self._refused = True
            # not super(): a refused connection is never parsed, served, or known to uvicorn's shutdown
            self.transport = transport
            self._answer_and_close(REFUSAL)
            return
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._answered:
            self._drained += len(data)
            if self._drained > REFUSAL_DRAIN_BYTES and not self.transport.is_closing():
                self.transport.pause_reading()
            return
        # bytes while no request is in progress start the next request's headers (even bare CRLFs, which
        # the parser skips: they cancel uvicorn's keep-alive timer, so they must not hold the connection)
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_deadline()
        if self._in_head:
            seen = self._head_bytes
            self._head_bytes = seen + len(data)
            if self._head_bytes > self.max_header_bytes and not _head_ends(data, self.max_header_bytes - seen):
                self._refuse_request(_HeadRefused("header_too_large", HEADERS_TOO_LARGE))
                return
        # uvicorn's data_received, but a head we refuse is answered by us, without a log line per request
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadRefused):
                self._refuse_request(exc.__context__)
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
                # this protocol is done (the WebSocket's now): its parser and its scope refer back to it,
                # cycles that would keep the head (URL, headers) until a full collection (gateway/ops/gcpolicy.py)
                self._break_cycles()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        self._header_count = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise _HeadRefused("header_too_large", HEADERS_TOO_LARGE)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if self.hosts is not None:
            for name, value in self.headers:
                if name == b"host" and not self.hosts.allows(value):
                    raise _HeadRefused("bad_host", BAD_HOST)
        self._cancel_timer()
        cast(dict[str, Any], self.scope).setdefault("extensions", {})[SCOPE_KEY] = self
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        super().on_message_complete()

    def _refuse_request(self, refusal: _HeadRefused) -> None:
        """Answer a refused request head and close (a response under way on this connection: close only)."""
        self._answered = True
        self._cancel_timer()
        self._unset_keepalive_if_required()
        self.limiter.refuse(refusal.reason, peer_ip(self.transport))
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # pipelined behind a response still being written: no answer in its midst
        else:
            self._answer_and_close(refusal.answer)

    def _answer_and_close(self, answer: bytes) -> None:
        transport = self.transport
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()  # the peer's own close then ends it (eof_received returns None)
            self._timer = self.loop.call_later(REFUSAL_LINGER_S, transport.close)
        else:  # TLS: closing runs the TLS shutdown, which reads the peer's input meanwhile
            transport.close()

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
            # uvicorn's own connection_lost is not run: drop the parser, whose callbacks refer back to this
            # protocol (a cycle that would wait for a full collection, gateway/ops/gcpolicy.py)
            self.parser = None  # type: ignore[assignment]
            return
        self.limiter.release(self.transport)
        super().connection_lost(exc)
        self._break_cycles()
        if self.stream is not None:
            self.stream.on_lost()

    def _break_cycles(self) -> None:
        self.parser = None  # type: ignore[assignment]
        scope = cast("dict[str, Any] | None", self.scope)
        if scope is not None:
            scope.get("extensions", {}).pop(SCOPE_KEY, None)

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


def http_protocol_class(
    limiter: ConnectionLimiter,
    header_timeout_s: float,
    max_header_bytes: int = 16384,
    max_headers: int = 100,
    hosts: HostPolicy | None = None,
    internal: bool = False,
) -> type[GuardedHttpToolsProtocol]:
    attrs = {
        "limiter": limiter,
        "header_timeout_s": header_timeout_s,
        "max_header_bytes": max_header_bytes,
        "max_headers": max_headers,
        "hosts": hosts,
        "internal": internal,
    }
    return type("ConfiguredGuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attrs)
