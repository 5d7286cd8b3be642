"""SSE transport (Server-Sent Events): the WebSocket's batches on a `text/event-stream`, commands by POST.

`GET /sse?topics=a,b` opens a stream, which is the session: its first event names a 128-bit secret for
`POST /sse/{secret}` (commands, as on long-poll) and `DELETE /sse/{secret}`; the session ends with the
stream's connection. The contract, event by event, is docs/protocol.md `## SSE`.

The write path is the WebSocket's (gateway/transports/ws.py): the response head goes through ASGI `send` (so the
Origin middleware adds its CORS headers), then the scheduler writes each batch as one HTTP chunk straight
to the transport, never awaiting. uvicorn runs our httptools protocol (gateway/edge/netguard.py), which exposes
itself in the ASGI scope and tells the stream of `pause_writing` / `resume_writing` / `connection_lost`:
a client whose write did not drain below the high-water mark is not ready, and one blocked longer than
`websocket.blocked_timeout_s` is cut by the client registry's watchdog with 4008. The batch bytes are the shared frame;
the only per-client bytes are the chunk header and the `id:` line (the connection's positions, read from
its subscription cursors after the cycle: O(its subscriptions), and only written when they changed).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core import Batch
from core.client import Client, Subscription
from core.config import MAX_SEQ
from core.errors import RequestError, TooManySubscriptions

from .. import schema
from ..admission import TooManyPendingConnects
from ..edge.http_errors import error_response
from ..edge.netguard import SCOPE_KEY, GuardedHttpToolsProtocol
from ..errors import BadRequest, UnknownSession
from ..scheduler import Delivered
from ..session import ClientSession, LateRefused, session_store
from ..session_services import SessionServices
from ..session_store import new_secret
from ..session_tables import Checkpoints
from .handshake import http_refusal
from .posted import accept_commands, backend_refusal
from .staging import StagedWriter
from .streams import KICK_GRACE_S, tune_stream

log = logging.getLogger("gateway.sse")

#: close code of a stream ended by `DELETE /sse/{secret}` (a normal closure, RFC 6455 §7.4.1)
DELETED = 1000
STREAM_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]
PING = b": ping\n\n"
LAST_CHUNK = b"0\r\n\r\n"
#: an item of a recovery point: seq in decimal, at most 16 digits (2^53 has 16)
_SEQ = re.compile(r"[0-9]{1,16}")
#: longest `id:` value (bytes): past it the compact form (`IdLine`)
MAX_ID_BYTES = 4096
#: characters that cannot stand in a position: the item separator, and what would end the `id:` line or
#: make a browser ignore it (NUL)
_UNSAFE_IN_ID = re.compile("[,\n\r\0]")
UNKNOWN_SESSION = UnknownSession("no such SSE session (its stream ended)")


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk (RFC 9112 §7.1)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def close_event(code: int, reason: str, retry_ms: int | None = None) -> bytes:
    data: dict[str, object] = {"code": code, "reason": reason[:120]}
    if retry_ms is not None:  # a drain (1012): the reconnect hint
        data["retry_ms"] = retry_ms
    return b"event: close\ndata: " + orjson.dumps(data) + b"\n\n"


# -- positions: the `id:` line and the recovery point ------------------------------------------------------


def parse_positions(text: str, max_items: int) -> dict[str, tuple[str, int]]:
    """A recovery point (`Last-Event-ID` or `since`): comma-joined `EPOCH:TOPIC:SEQ` items -> {topic: (epoch,
    seq)}, in order. The empty string is no position. Raises BadRequest saying what is wrong, nothing else."""
    if not text:
        return {}
    if text.count(",") >= max_items:
        raise BadRequest(f"the recovery point has more than {max_items} positions (scheduler.max_subscriptions)")
    positions: dict[str, tuple[str, int]] = {}
    for number, item in enumerate(text.split(","), 1):
        epoch, colon, rest = item.partition(":")
        topic, colon2, seq_text = rest.rpartition(":")
        if not colon or not colon2:
            raise BadRequest(f"position {number} of the recovery point is not EPOCH:TOPIC:SEQ")
        if not epoch:
            raise BadRequest(f"position {number} of the recovery point has an empty epoch")
        if not topic or len(topic) > schema.MAX_TOPIC_CHARS:
            raise BadRequest(f"position {number} of the recovery point needs a topic of 1..{schema.MAX_TOPIC_CHARS} characters")
        if not _SEQ.fullmatch(seq_text) or int(seq_text) >= MAX_SEQ:
            raise BadRequest(f"position {number} of the recovery point needs a seq of decimal digits in [0, 2**53)")
        if topic in positions:
            raise BadRequest(f"position {number} of the recovery point names a topic already given")
        positions[topic] = (epoch, int(seq_text))
    return positions


def recoverable(topic: str) -> bool:
    """Whether a topic's name can stand in a position (`id:` line)."""
    return _UNSAFE_IN_ID.search(topic) is None


class Positions:
    """The `id:` value of one client: one `EPOCH:TOPIC:NEXT` per ring or snapshot subscription, NEXT being the
    seq the client needs next (the cursor, read after the cycle that filled the batch). Private topics are
    left out (their queue waits for the user, docs/design/private-queues.md).

    O(the client's subscriptions) per call, one string concatenation each: the `EPOCH:TOPIC:` prefix is
    made once per subscription and epoch (a topic restarted by a broker changes epoch in place) and kept
    (checking and formatting every name on every batch cost 6x more: ~0.6 µs per subscription). Prefixes
    of dropped subscriptions are forgotten once they are as many as the live ones, so the cache stays
    within twice the subscriptions (amortized O(1))."""

    __slots__ = ("client", "_prefixes")

    def __init__(self, client: Client) -> None:
        self.client = client
        #: subscription -> (the epoch, its "EPOCH:TOPIC:" prefix, "" when it has no position: private, unsafe name)
        self._prefixes: dict[Subscription, tuple[str, str]] = {}

    def __call__(self) -> bytes:
        return ",".join(self.items()).encode()

    def items(self) -> list[str]:
        """The `EPOCH:TOPIC:NEXT` items, in subscription order."""
        subs = self.client.subs
        prefixes = self._prefixes
        parts = []
        for sub in subs.values():
            topic = sub.topic
            cached = prefixes.get(sub)
            if cached is None or cached[0] is not topic.epoch:
                safe = topic.shared and recoverable(topic.name)
                cached = prefixes[sub] = (topic.epoch, f"{topic.epoch}:{topic.name}:" if safe else "")
            if cached[1]:
                parts.append(cached[1] + str(sub.cursor))
        if len(prefixes) > 2 * len(subs) + 16:
            self._prefixes = {sub: prefixes[sub] for sub in subs.values()}
        return parts


class IdLine:
    """The `id:` value of a stream, bounded by `MAX_ID_BYTES` (unbounded, one message took 265 KB per event with
    1,000 subscriptions). Full POSITIONS while they fit; past it the compact form `~KEY.N,ITEMS`: checkpoint
    N of this stream, a full POSITIONS kept by the gateway (`Checkpoints`), and the items that differ from it.
    A new checkpoint is taken when the items would pass half the bound, or a topic of the checkpoint was
    left, so the line stays within the bound and a checkpoint costs O(subscriptions) once per half a bound
    of items written."""

    __slots__ = ("positions", "table", "key", "number", "base")

    def __init__(self, positions: Positions, table: Checkpoints) -> None:
        self.positions = positions
        self.table = table
        self.key = secrets.token_urlsafe(9)
        self.number = 0
        #: the current checkpoint's items, by topic (None: the full form is in use)
        self.base: dict[str, str] | None = None

    def __call__(self) -> bytes:
        items = self.positions.items()
        full = ",".join(items)
        if len(full) <= MAX_ID_BYTES:
            self.base = None
            return full.encode()
        base = self.base
        changed: list[str] = []
        if base is not None:
            present = 0
            for item in items:
                topic = _topic_of(item)
                present += topic in base
                if base.get(topic) != item:
                    changed.append(item)
            if present < len(base) or sum(map(len, changed)) + len(changed) > MAX_ID_BYTES // 2:
                base = None  # a topic of the checkpoint was left, or the items outgrew half the bound
        if base is None:
            self.number += 1
            self.base = {_topic_of(item): item for item in items}
            self.table.put(self.key, self.number, full)
            changed = []
        head = f"~{self.key}.{self.number}"
        return (head + "," + ",".join(changed) if changed else head).encode()

    def ended(self) -> None:
        self.table.ended(self.key)


def _topic_of(item: str) -> str:
    return item[item.index(":") + 1 : item.rindex(":")]


def recovery_point(text: str, max_items: int, table: Checkpoints) -> dict[str, tuple[str, int]]:
    """`parse_positions`, and the compact form `~KEY.N,ITEMS` (`IdLine`): checkpoint N's positions with ITEMS
    over them. Raises BadRequest (a malformed text, or a checkpoint no longer kept)."""
    if not text.startswith("~"):
        return parse_positions(text, max_items)
    ref, _, rest = text.partition(",")
    key, dot, number = ref[1:].rpartition(".")
    if not dot or not number.isdigit() or len(number) > 16:
        raise BadRequest("the recovery point's checkpoint is not ~KEY.N")
    base = table.get(key, int(number))
    if base is None:
        raise BadRequest(
            "the recovery point's checkpoint is no longer kept (gateway restarted, another process, or ended too long ago)"
        )
    positions = parse_positions(base, max_items)
    for topic, point in parse_positions(rest, max_items).items():
        positions[topic] = point
    if len(positions) > max_items:
        raise BadRequest(f"the recovery point has more than {max_items} positions (scheduler.max_subscriptions)")
    return positions


# -- the connection ------------------------------------------------------------------------------------------


class SseConnection(StagedWriter):
    """One stream: a `Connection` of the scheduler (gateway/scheduler.py) and the `StreamListener` of its HTTP
    protocol. Made before its client opens (nothing happens until `start`)."""

    #: the client's session, which hears of the stream's write state and loss
    session: ClientSession

    def __init__(self, session: ClientSession, proto: GuardedHttpToolsProtocol, secret_prefix: str = "") -> None:
        #: the write pause, kept here: the HTTP protocol tells the stream (`on_pause`, `on_resume`)
        self.paused = False
        super().__init__(session, self)
        self.config = session.config
        self.store = session.store
        self.proto = proto
        self.transport = proto.transport
        #: the session id of the URLs, the only credential of POST and DELETE (`new_secret`)
        self.secret = new_secret(secret_prefix)
        #: the positions of the engine's client (read, never changed), after each cycle
        self.positions_of: IdLine | None = None
        #: the positions last written in an `id:` line (a browser starts with the empty one)
        self.positions = b""
        self.events_sent = 0
        self.bytes_sent = 0
        #: entries (messages, notices, replies) handed to this connection: the stats stream's delivery rate
        self.entries_sent = 0
        self.closed = False
        self.last_write = time.monotonic()
        self._heartbeat: asyncio.TimerHandle | None = None
        self._cut: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """The client is open: tune the socket as the WebSocket's, write the session event, start beating
        (not when closed meanwhile)."""
        if self.closed:
            return
        ws = self.config.websocket
        tune_stream(self.transport, ws.write_high_water, ws.socket_send_buffer, ws.notsent_lowat_bytes)
        session = orjson.dumps({"session": self.secret, "client_id": self.identity.client_id})
        self._write(b"event: session\ndata: " + session + b"\n\n")
        self.store.sse.add(self)
        if self.config.sse.heartbeat_s > 0:
            self._arm_heartbeat(self.config.sse.heartbeat_s)

    def _write(self, event: bytes) -> None:
        self.transport.write(chunk(event))
        self.last_write = time.monotonic()

    # -- fan-out writes ----------------------------------------------------------------------------------

    def deliver(self, batch: Batch, frame: bytes) -> Delivered:
        transport = self.transport
        if self.closed or transport.is_closing():
            return Delivered.BLOCKED
        self.events_sent += 1
        self.entries_sent += len(batch.entries)
        head = b"data: "
        if self.positions_of is not None:
            positions = self.positions_of()
            if positions != self.positions:
                self.positions = positions
                head = b"id: " + positions + b"\ndata: "
        size = len(head) + len(frame) + 2
        self.bytes_sent += size
        # one chunk, the shared frame not copied: chunk size, head, frame, then event end + chunk end
        return self.write_batch((b"%x\r\n" % size, head, frame, b"\n\n\r\n"), size, batch.more)

    def _stream(self) -> asyncio.Transport | None:
        transport = self.transport
        return None if self.closed or transport.is_closing() else transport

    def _written(self) -> None:
        self.last_write = time.monotonic()

    # -- the HTTP protocol's StreamListener --------------------------------------------------------------

    def on_pause(self) -> None:
        self.paused = True

    def on_resume(self) -> None:
        self.paused = False
        self._drained()

    def on_lost(self) -> None:
        """The connection is gone: nothing more is written, and the client is forgotten."""
        self.closed = True
        if self.positions_of is not None:
            self.positions_of.ended()
            self.positions_of = None
        self._stop()
        if self._cut is not None:
            self._cut.cancel()
            self._cut = None
        self.session.gone()

    # -- control -------------------------------------------------------------------------------------------

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        """Write the close event behind what is buffered, end the response, and close: a reader that wakes up
        gets the code; one that never reads is cut after the grace (its buffer will not drain)."""
        if self.closed:
            return
        self.flush()  # the round's staged events go before the close event
        self.closed = True  # the hub unregisters it, which also forgets it as blocked
        self._stop()
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(chunk(close_event(code, reason, retry_ms)) + LAST_CHUNK)
        # not close(): with the peer's input unread the kernel could answer RST and destroy the close event
        if transport.can_write_eof():
            transport.write_eof()
        else:  # TLS: its close_notify ends the stream cleanly
            transport.close()
        self._cut = self.proto.loop.call_later(KICK_GRACE_S, transport.abort)

    def _stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        self.store.sse.discard(self)

    def _arm_heartbeat(self, delay: float) -> None:
        self._heartbeat = self.proto.loop.call_later(delay, self._beat)

    def _beat(self) -> None:
        # One timer per stream, re-armed lazily: writes only stamp `last_write`.
        period = self.config.sse.heartbeat_s
        quiet = time.monotonic() - self.last_write
        if quiet < period:
            self._arm_heartbeat(period - quiet)
            return
        if not self.paused and not self.transport.is_closing():  # a blocked stream is not quiet: data waits
            self._write(PING)
        self._arm_heartbeat(period)

    def describe(self) -> dict[str, Any]:
        return {
            "transport": "sse",
            "peer": self.identity.peer,
            "events_sent": self.events_sent,
            "bytes_sent": self.bytes_sent,
            "entries_sent": self.entries_sent,
            "write_blocked": self.blocked_since is not None,
        }


# -- endpoints ---------------------------------------------------------------------------------------------


def close_only(code: int, reason: str) -> Response:
    """A refusal an `EventSource` can read: a 200 stream whose only event is `close`."""
    return Response(close_event(code, reason), headers={k.decode(): v.decode() for k, v in STREAM_HEADERS})


class _Stream(Response):
    """The event stream of one connection; lives until the connection is lost."""

    def __init__(
        self,
        session: ClientSession,
        proto: GuardedHttpToolsProtocol,
        topics: list[str],
        positions: dict[str, tuple[str, int]],
        refusals: list[RequestError],
        secret_prefix: str = "",
    ) -> None:
        super().__init__()
        #: the client, holding its places in the bounds until it opens (gateway/session.py)
        self.session = session
        self.proto = proto
        self.topics = topics
        self.recovery = positions
        self.refusals = refusals
        self.secret_prefix = secret_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session = self.session
        try:
            await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
        except BaseException:
            session.gone()
            raise
        if self.proto.transport.is_closing():  # gone before the head: nothing to open
            session.gone()
            return
        conn = SseConnection(session, self.proto, self.secret_prefix)
        reason = "closed"
        try:
            try:
                session.open(conn)
            except LateRefused as late:  # revoked, disconnected or draining before it registered: its only event
                refusal = late.refusal
                await send({"type": "http.response.body", "body": close_event(refusal.code, refusal.reason, refusal.retry_ms)})
                return
            self.proto.stream = conn
            conn.start()
            if session.live:  # else cut as it registered (the connect hook's topics)
                conn.positions_of = IdLine(Positions(session.client_state()), conn.store.checkpoints)
                self._subscribe()
            # The request has no body: what comes next is the disconnect (the connection was lost), also
            # after a kick (the close event written, the connection closed within KICK_GRACE_S).
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:
            log.exception("SSE stream %s failed", session.identity.client_id)
            reason = "error"
        finally:
            session.gone(reason)
            conn.on_lost()
            if self.proto.stream is conn:
                self.proto.stream = None

    def _subscribe(self) -> None:
        """The request's subscriptions, as commands: same checks and answers as a `subscribe`."""
        session = self.session
        for refusal in self.refusals:
            session.send_error(refusal)
        names = self.topics + [name for name in self.recovery if name not in self.topics]
        for name in names:
            if not session.live:
                return  # cut by an earlier subscribe (direct queue)
            command: dict[str, Any] = {"op": "subscribe", "topic": name}
            if name in self.recovery:
                epoch, seq = self.recovery[name]
                command["since"] = {"epoch": epoch, "seq": seq}
            session.command(command)


async def stream(request: Request) -> Response:
    """`GET /sse?topics=a,b[&token=JWT][&since=POSITIONS]` (docs/protocol.md `## SSE`)."""
    services: SessionServices = request.app.state.services
    query = request.query_params
    proto = request.scope.get("extensions", {}).get(SCOPE_KEY)
    if not isinstance(proto, GuardedHttpToolsProtocol):  # a bug: server.py always runs it
        raise RuntimeError("SSE needs the gateway's HTTP protocol (gateway.edge.netguard.GuardedHttpToolsProtocol)")
    try:
        session = ClientSession.begin(services, "sse", request.client, token=query.get("token"), requested_id=query.get("id"))
    except RequestError as exc:
        if exc.close_code is None or isinstance(exc, TooManyPendingConnects):  # the bounds: an HTTP error
            return http_refusal(services.config, exc)
        return close_only(exc.close_code, exc.message)  # ?id=, the token: a stream an EventSource can read
    refusal = await backend_refusal(session, request)
    if refusal is not None:
        return refusal
    refusals: list[RequestError] = []
    max_subs = services.config.scheduler.max_subscriptions
    topics = [name for name in ",".join(query.getlist("topics")).split(",") if name]
    if len(topics) > max_subs:
        refusals.append(
            TooManySubscriptions(
                f"{len(topics) - max_subs} topics beyond scheduler.max_subscriptions ({max_subs}) were not subscribed"
            )
        )
        topics = topics[:max_subs]
    recovery_text = request.headers.get("last-event-id")
    if recovery_text is None:
        recovery_text = query.get("since", "")
    try:
        positions = recovery_point(recovery_text, max_subs, session.store.checkpoints)
    except BadRequest as exc:
        session.bad_input("%s: %s", session.identity.ip, exc.message)
        refusals.insert(0, exc)
        positions = {}
    return _Stream(session, proto, topics, positions, refusals, request.app.state.session_prefix)


def _stream_of(request: Request) -> SseConnection | Response:
    """The stream the path names, or the error response (no such session)."""
    conn = session_store(request.app.state.services).sse.get(request.path_params["session"])
    if not isinstance(conn, SseConnection):
        return error_response(UNKNOWN_SESSION)
    return conn


async def post_commands(request: Request) -> Response:
    found = _stream_of(request)
    if isinstance(found, Response):
        return found
    return await accept_commands(request, found.session, found.config.sse.max_body_bytes)


async def delete_session(request: Request) -> Response:
    found = _stream_of(request)
    if isinstance(found, Response):
        return found
    found.session.close(DELETED, "session deleted")
    return Response(status_code=204)
