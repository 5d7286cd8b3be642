"""Session requests that land on another worker (docs/cluster.md §5).

With `server.workers = N` the kernel spreads each new TCP connection over the workers, but a long-poll
session or an SSE stream lives in one worker's memory. So the session secret names its owner: worker `i`
hands out `w{i}.` + 128 random bits (the prefix is public and adds nothing to guess; the random part is the
secret, as with one worker). A request for `/lp/{secret}` or `/sse/{secret}` that reaches another worker is
forwarded to the owner over a connection only the workers can make: the forwarder makes a connected pair of
Unix stream sockets (`socketpair`), and hands one end to the owner through the owner's *inbox*
(`SCM_RIGHTS`), a datagram socketpair the supervisor makes per worker before forking and keeps, so that a
worker forked again in place of a dead one receives on the same inbox; the owner serves the app on it as on a
client connection (`WorkerLinks`). No socket has an address another process could connect to (the
internal sockets used to be loopback TCP ports, which served the whole app to any local process), and the
owner serves at most `server.max_connections` such connections at once (beyond: `503`).

`SessionRouter` is an ASGI middleware (inside the Origin guard, so the worker that received the request
answers CORS and preflights itself). On a client's connection it forwards what another worker owns; on an
internal connection it never forwards (no loops) and, when the hop carries the cluster's key, takes the
client's address from `X-Forwarded-For` so that logs and per-address checks see the real client. With one
worker there are no links, no prefix, no inbox, and no router.

Descriptors: each forward holds one here (its end of the pair) and one at the owner, on top of the client's
connection; forwards out of a worker are bounded by its client connections (`server.max_connections`), those
into it by the same number, so a worker holds at most 3 x `server.max_connections` sockets (the start-up
descriptor check counts them, gateway/server.py).

The forwarder is a small HTTP/1.1 client on h11 (which writes the request and parses the response: status
line, headers, chunked / content-length / close framing): one internal connection per forwarded request
(`Connection: close`, so the end of the response is the end of the connection), the request body read here
with the route's bound and sent with its length, the response streamed back as it comes (a long poll waits
up to `longpoll.poll_timeout_s` on the owner), and the upstream connection closed as soon as the client goes.
A response h11 cannot parse (or a head over MAX_HEAD_BYTES, h11's `max_incomplete_event_size`) is a failure of
the owner: `500 internal_error` while nothing was sent, else the response ended short. A request h11 will not
write (it was parsed by httptools, which lets through what HTTP/1.1 forbids, such as two `Host` lines) gets
`400 bad_request`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

import h11
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from core.errors import RequestError

from ..config import GatewayConfig
from ..edge.addrcount import SharedCounts
from ..edge.bodies import read_body
from ..edge.http_errors import error_response
from ..edge.netguard import SCOPE_KEY
from ..errors import BadRequest, InternalError, TooManyConnections

log = logging.getLogger("gateway.forward")

#: `/lp/{secret}` and `/sse/{secret}` whose secret starts with `w{index}.` (token_urlsafe has no dot); at most
#: 4 digits: far more workers than a machine has cores
_ROUTED = re.compile(r"/(lp|sse)/w([0-9]{1,4})\.[^/]*")
#: header of a hop between workers: the cluster's key (random, made by the supervisor, never sent to clients)
KEY_HEADER = b"x-fanout-forward"
#: headers that belong to one connection (RFC 9110 §7.6.1) or are remade for the hop
#: (`expect`: this worker read the body already; the owner must not answer `100 Continue`)
_HOP_REQUEST = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"trailer",
        b"proxy-connection",
        b"content-length",
        b"expect",
        b"x-forwarded-for",
        KEY_HEADER,
    }
)
#: the methods of the session routes; others (HEAD, OPTIONS) are answered here, by the Origin guard or 404/405
FORWARDED_METHODS = frozenset({"GET", "POST", "DELETE"})
#: response headers not passed back: hop-by-hop ones, those uvicorn writes itself here (date, server), and the
#: owner's CORS headers (this worker's Origin guard adds its own)
_HOP_RESPONSE = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"trailer",
        b"date",
        b"server",
        b"vary",
        b"access-control-allow-origin",
        b"access-control-expose-headers",
    }
)

#: seconds to open the internal connection (the pair and its passing are immediate; a bound all the same)
CONNECT_TIMEOUT_S = 2.0
#: seconds the owner may take to answer beyond what the request itself waits (a long poll's timeout); also the
#: longest wait between two pieces of a response body
RESPONSE_TIMEOUT_S = 10.0
#: bytes of the owner's status line and headers at most (ours are a few hundred): h11's
#: `max_incomplete_event_size`, and no more is read while a head is incomplete
MAX_HEAD_BYTES = 64 * 1024
#: bytes read from the owner at once
READ_CHUNK = 64 * 1024
#: concurrent forwards of a worker when `server.max_connections` is 0 (no limit). Otherwise the bound is
#: `server.max_connections`: each forward sits on one admitted client connection (HTTP/1.1: one request at a
#: time), so the bound only matters when that limit is off; each forward holds two descriptors (ours, the
#: owner's). The same number bounds the internal connections a worker serves at once.
MAX_FORWARDS_UNLIMITED = 16384
#: file descriptors passed per inbox read
_FDS_PER_READ = 16


@dataclass(frozen=True, slots=True)
class WorkerLinks:
    """What a worker knows of the others: made by the supervisor (gateway/workers/supervisor.py)."""

    #: this worker's index, 0..N-1
    index: int
    #: every worker's inbox, by index: the sending end of a datagram socketpair (None: this worker's own)
    outboxes: tuple[socket.socket | None, ...]
    #: this worker's inbox: the receiving end, where the others pass the connections they forward
    inbox: socket.socket
    #: the key a hop carries, so that only another worker's `X-Forwarded-For` is believed
    key: str
    #: counts of the per-address limits, shared by every worker (gateway/edge/addrcount.py)
    counts: SharedCounts | None = None

    @property
    def secret_prefix(self) -> str:
        return f"w{self.index}."


def make_inbox() -> tuple[socket.socket, socket.socket]:
    """(receiving, sending) ends of one worker's inbox; made by the supervisor before it forks, and kept by it
    for the worker's restarts."""
    receiving, sending = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiving.setblocking(False)
    sending.setblocking(False)
    return receiving, sending


def serve_inbox(inbox: socket.socket, serve: Callable[[socket.socket], object]) -> None:
    """Watch this worker's inbox on the running loop: `serve(sock)` each connection passed to it."""

    def readable() -> None:
        while True:
            try:
                _data, fds, _flags, _addr = socket.recv_fds(inbox, 1, _FDS_PER_READ)
            except (BlockingIOError, InterruptedError):
                return
            for fd in fds:
                serve(socket.socket(fileno=fd))

    asyncio.get_running_loop().add_reader(inbox.fileno(), readable)


def _connect(outbox: socket.socket) -> socket.socket:
    """A new connection to the worker of `outbox`: our end of a pair whose other end is passed to it.
    Raises OSError (e.g. the owner is gone, or its inbox is full)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        socket.send_fds(outbox, [b"c"], [theirs.fileno()])
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    ours.setblocking(False)
    return ours


def new_key() -> str:
    return secrets.token_urlsafe(16)


def owner_of(path: str) -> int | None:
    """The worker index a session path names, None when it names none (then the local tables answer)."""
    match = _ROUTED.fullmatch(path)
    return int(match.group(2)) if match else None


class _Refused(Exception):
    """The owner could not be reached, or answered out of bounds: the client gets `internal_error`."""


class SessionRouter:
    """ASGI middleware: forward a session request to the worker that owns it (module docstring)."""

    def __init__(self, app: ASGIApp, links: WorkerLinks, config: GatewayConfig) -> None:
        self.app = app
        self.links = links
        self.key = links.key.encode()
        self.poll_timeout_s = config.longpoll.poll_timeout_s
        self.max_body = {"lp": config.longpoll.max_body_bytes, "sse": config.sse.max_body_bytes}
        self.max_forwards = config.server.max_connections or MAX_FORWARDS_UNLIMITED
        #: forwards under way (the bound above)
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        protocol = scope.get("extensions", {}).get(SCOPE_KEY)
        if protocol is not None and protocol.internal:
            return await self.app(self._trusted(scope), receive, send)
        owner = owner_of(scope["path"])
        if (
            owner is None
            or owner == self.links.index
            or owner >= len(self.links.outboxes)
            or scope["method"] not in FORWARDED_METHODS
        ):
            return await self.app(scope, receive, send)  # an index no worker has: the tables say 404
        if self.active >= self.max_forwards:
            response = error_response(
                TooManyConnections(f"this worker forwards {self.active} session requests already; retry later"),
                {"Retry-After": "1"},
            )
            return await response(scope, receive, send)
        self.active += 1
        try:
            await self._forward(owner, scope, receive, send)
        finally:
            self.active -= 1

    def _trusted(self, scope: Scope) -> Scope:
        """A request on an internal connection: from another worker, which sends the key (then its client
        is `X-Forwarded-For`'s); without it, served as it is."""
        headers = dict(scope["headers"])
        if not secrets.compare_digest(headers.get(KEY_HEADER, b""), self.key):
            return scope
        client = headers.get(b"x-forwarded-for", b"").decode("latin-1").strip()
        return {**scope, "client": (client, 0)} if client else scope

    async def _forward(self, owner: int, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope["path"].split("/", 2)[1]
        try:
            body = await read_body(Request(scope, receive), self.max_body[transport])
        except RequestError as exc:
            return await error_response(exc)(scope, receive, send)
        upstream = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            request = self._request(upstream, scope, body)
        except h11.LocalProtocolError as exc:  # httptools let it through; HTTP/1.1 forbids it
            return await error_response(BadRequest(f"this request cannot be forwarded: {exc}"))(scope, receive, send)
        wait = RESPONSE_TIMEOUT_S + (self.poll_timeout_s if transport == "lp" and scope["method"] == "GET" else 0)
        exchange = asyncio.ensure_future(self._exchange(owner, upstream, request, wait, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((exchange, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not exchange.done():  # the client left: close the upstream, as if the client had left the owner
                exchange.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            await asyncio.wait((exchange,))  # a cancelled one ends too (it closes the upstream on its way out)
        if exchange.cancelled():
            return
        failure = exchange.exception()
        if failure is None:
            return
        if not isinstance(failure, _Refused):
            raise failure
        reason, begun = failure.args
        log.warning("forward to worker %d failed: %s", owner, reason)
        if not begun:
            await error_response(InternalError(f"the worker holding this session did not answer ({reason})"))(
                scope, receive, send
            )

    def _request(self, upstream: h11.Connection, scope: Scope, body: bytes) -> bytes:
        """The bytes of the request to the owner, written by `upstream`. Raises h11.LocalProtocolError."""
        target = scope.get("raw_path") or scope["path"].encode()
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        # httptools keeps a value's trailing whitespace, which is no part of it (RFC 9110 §5.5) and h11 refuses
        headers = [(name, value.strip(b" \t")) for name, value in scope["headers"] if name not in _HOP_REQUEST]
        if not any(name == b"host" for name, _ in headers):
            headers.append((b"host", b""))  # none (HTTP/1.0, services): an empty one, which HTTP/1.1 requires
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", str(client[0]).encode("latin-1")))
        headers += [(KEY_HEADER, self.key), (b"content-length", b"%d" % len(body)), (b"connection", b"close")]
        data = upstream.send(h11.Request(method=scope["method"], target=target, headers=headers)) or b""
        if body:
            data += upstream.send(h11.Data(data=body)) or b""
        return data + (upstream.send(h11.EndOfMessage()) or b"")

    async def _exchange(self, owner: int, upstream: h11.Connection, request: bytes, wait: float, send: Send) -> None:
        """Send the request to the owner and stream its response to `send`. Raises _Refused(reason, begun)."""
        begun = False
        writer: asyncio.StreamWriter | None = None
        try:
            outbox = self.links.outboxes[owner]
            assert outbox is not None  # not this worker's own
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, stream = await asyncio.open_connection(sock=_connect(outbox), limit=READ_CHUNK)
            writer = stream
            stream.write(request)
            loop = asyncio.get_running_loop()
            head_by = loop.time() + wait  # the response's head (a long poll's answer comes with its timeout)
            while True:
                event = upstream.next_event()
                if event is h11.NEED_DATA:
                    if begun:  # a piece of the body
                        async with asyncio.timeout(RESPONSE_TIMEOUT_S):
                            data = await reader.read(READ_CHUNK)
                    else:  # no more than the head's bound is ever buffered (h11 checks it once a read is in)
                        size = max(1, MAX_HEAD_BYTES - len(upstream.trailing_data[0]))
                        async with asyncio.timeout_at(head_by):
                            data = await reader.read(size)
                    upstream.receive_data(data)  # b"": the owner closed (h11 says whether the response is whole)
                elif isinstance(event, h11.Response):
                    if not event.http_version.startswith(b"1."):  # h11 parses any HTTP/d.d status line
                        raise h11.RemoteProtocolError(f"not an HTTP/1 response: HTTP/{event.http_version.decode()}")
                    chunked = any(name == b"transfer-encoding" for name, _ in event.headers)
                    headers = [
                        (name, value)
                        for name, value in event.headers
                        if name not in _HOP_RESPONSE and not (chunked and name == b"content-length")
                    ]
                    await send({"type": "http.response.start", "status": event.status_code, "headers": headers})
                    begun = True
                elif isinstance(event, h11.Data):  # as it comes: an SSE-like stream or a long poll's answer
                    await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
                elif isinstance(event, h11.EndOfMessage):  # trailers, if any, are dropped
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                elif isinstance(event, h11.InformationalResponse):
                    continue  # interim answers (none expected: no `Expect` is sent) are skipped
                else:  # ConnectionClosed or PAUSED: not before the end of the response
                    raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} before the response's end")
        except (OSError, asyncio.TimeoutError, h11.ProtocolError) as exc:
            if begun:  # the head is sent: all that can be done is to end the response short
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise _Refused(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, begun) from None
        finally:
            if writer is not None:
                writer.close()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client's connection is gone (the request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass
