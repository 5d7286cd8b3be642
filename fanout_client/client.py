"""The asyncio client of fanout-gateway over WebSocket: the Python twin of static/fanout.js (docs/client.md,
"The Python client: fanout_client").

    async with fanout_client.connect("http://127.0.0.1:8080", get_token=fetch_token) as client:
        sub = await client.subscribe("prices.eurusd")
        async for event in sub:                       # Message or Loss, in order
            ...

A `Client` outlives its connections: it reconnects with full-jitter backoff, resubscribes every
subscription with ``since`` (its epoch and the next seq it needs), drops redeliveries, asks ``get_token``
for a fresh token when the gateway says the token expired (``auth`` on the live connection) and on the close
codes 4001 and 4011, and follows the close-code table of fanout.js. Every buffer has a bound: requests
(``max_pending_requests``; control commands: one per kind and topic, `PendingTable.new_control`), each
subscription's events (``max_queued_events``, policy in `Subscription`), frames (``max_frame_bytes``, near
the largest frame a gateway builds; `RECEIVE_QUEUE_FRAMES` read ahead), writes (the WebSocket library's
32 KiB write buffer; replies it owes a gateway that reads nothing: `REPLY_BYTES_WHILE_BLOCKED`, then the
connection is dropped), and log lines (`LOG_BURST` per `LOG_WINDOW_S`).
A delta that does not apply resubscribes after a backoff (`Subscription._delta_failed`), so a gateway that
answers every resubscribe with another bad delta meets a growing delay, not a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeAlias, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from .events import Event, FanoutError, Message, Position, Stream, TopicKind
from .fossil import DeltaBase, DeltaError
from .outgoing import Outgoing
from .pending import Pending, PendingTable

__all__ = ["Client", "ClientState", "CloseInfo", "Subscription", "TokenSource", "connect"]

log = logging.getLogger("fanout_client")

ClientState: TypeAlias = Literal["connecting", "connected", "disconnected", "closed"]
#: ``get_token``: a function returning a token (or None: no token to give), or an awaitable of one
TokenSource: TypeAlias = Callable[[], "str | None | Awaitable[str | None]"]

#: a connection that lived this long resets the backoff: the next reconnect is quick
STABLE_S = 10.0
#: close codes after which the client does not reconnect (4001 and 4011 depend on get_token)
TERMINAL = frozenset({4000, 4006})
#: how long `close` waits for the closing handshake before dropping the connection
CLOSE_TIMEOUT_S = 2.0
#: close 1012 (service restart): the gateway drains (SIGTERM) and says when to reconnect, each client its own
#: delay so that a restart does not make a thundering herd (docs/protocol.md)
SERVICE_RESTART = 1012
_RESTART_HINT = re.compile(r"reconnect in (\d{1,9}) ms")
#: close codes the client sends when it refuses what the gateway sent (protocol error, invalid data, a frame
#: too big): the code of the connection's `CloseInfo`, whether or not the gateway's close frame came back
REFUSAL_CODES = frozenset({1002, 1007, 1009})
#: the default ``max_frame_bytes``: a gateway's largest frame is a cycle's budget (scheduler.cycle_budget_bytes,
#: 64 KiB) plus one entry of at most 1 MiB (scheduler.max_message_bytes, scheduler.direct_queue_max_bytes),
#: ~1.07 MiB; a larger frame is refused from its header (1009), before it is read. Decoded, a frame of tiny JSON
#: values costs ~33 times its size (2 MiB of `[]`: 67 MiB; 64 MiB: 1.7 GB), so the bound stays near what a gateway sends.
DEFAULT_MAX_FRAME_BYTES = 2 * 1024 * 1024
#: frames the WebSocket library reads ahead of the client (its ``max_queue``, by default 16): with
#: ``max_frame_bytes``, at most 4 x 2 MiB wait, not yet decoded
RECEIVE_QUEUE_FRAMES = 4
#: bytes of replies the WebSocket library writes by itself (a pong for each ping, the close echo) while the
#: gateway reads nothing (the write buffer above its high-water mark, 32 KiB): past this the connection is
#: dropped (1006). A gateway pings every websocket.ping_interval_s (20 s); one pinging in a loop and never
#: reading made the client buffer +105 MiB of pongs in 10 s.
REPLY_BYTES_WHILE_BLOCKED = 64 * 1024
#: errors no request owns (``error`` entries without an id, ...) are logged at most LOG_BURST times per
#: LOG_WINDOW_S (without ``on_error``); the others are counted, and the count is logged with the next line let
#: through and by `Client.close` (a gateway sending 338,000 such entries in 5 s made as many log records)
LOG_BURST = 5
LOG_WINDOW_S = 10.0


def _full_jitter(attempt: int, base: float, maximum: float) -> float:
    """A delay uniform in [0, min(maximum, base * 2^attempt)): the reconnects' and the delta resubscribes'."""
    return random.uniform(0, min(maximum, base * 2 ** min(attempt, 30)))


def restart_hint_s(code: int, reason: str) -> float | None:
    """The reconnect delay (seconds) a draining gateway hinted: close 1012 with "restarting: reconnect in N
    ms" (an SSE close event or long-poll entry carries N as `retry_ms`); None for any other close."""
    if code != SERVICE_RESTART:
        return None
    match = _RESTART_HINT.search(reason)
    return int(match.group(1)) / 1000 if match else None


class _GuardedConnection(ClientConnection):
    """The WebSocket connection, dropped when a gateway that reads nothing makes it write replies without
    bound: websockets answers each ping with a pong at once, however much already waits to be written, so a
    gateway that pings in a loop and never reads grows the write buffer for ever (`REPLY_BYTES_WHILE_BLOCKED`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writes: asyncio.WriteTransport | None = None
        self._blocked = False
        self._replies_while_blocked = 0
        #: why the client dropped the connection (None: it did not)
        self.dropped_because: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._writes = cast(asyncio.WriteTransport, transport)  # a stream's (uvloop's are no subclass of it)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._blocked = True

    def resume_writing(self) -> None:
        super().resume_writing()
        self._blocked = False
        self._replies_while_blocked = 0

    def data_received(self, data: bytes) -> None:
        writes = self._writes
        assert writes is not None
        before = writes.get_write_buffer_size()
        super().data_received(data)  # may write replies (pongs)
        if not self._blocked or self.dropped_because is not None:
            return
        self._replies_while_blocked += max(0, writes.get_write_buffer_size() - before)
        if self._replies_while_blocked > REPLY_BYTES_WHILE_BLOCKED:
            self.dropped_because = (
                f"the gateway does not read: {self._replies_while_blocked} bytes of replies (pongs) wait to be written"
            )
            writes.abort()


class _LogBudget:
    """At most `LOG_BURST` log lines per `LOG_WINDOW_S`; the lines refused are counted, and the count is logged
    with the next line let through (and by `flush`)."""

    def __init__(self) -> None:
        self._window_start = -LOG_WINDOW_S
        self._lines = 0
        self.suppressed = 0

    def warning(self, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._window_start >= LOG_WINDOW_S:
            self._window_start, self._lines = now, 0
        if self._lines >= LOG_BURST:
            self.suppressed += 1
            return
        self._lines += 1
        self.flush()
        log.warning(message, *args, exc_info=exc_info)

    def flush(self) -> None:
        if self.suppressed:
            log.warning(
                "fanout_client: %d more errors were not logged (at most %d lines per %g s)",
                self.suppressed,
                LOG_BURST,
                LOG_WINDOW_S,
            )
            self.suppressed = 0


@dataclass(frozen=True, slots=True)
class CloseInfo:
    """How a connection ended: the WebSocket close code (1006: no close frame, or no connection at all)."""

    code: int
    reason: str


async def _ask_token(get_token: TokenSource | None) -> str | None:
    """The application's ``get_token`` asked for a token (awaited when it gives an awaitable)."""
    assert get_token is not None
    value = get_token()
    if inspect.isawaitable(value):
        value = await value
    if value is not None and not isinstance(value, str):
        raise TypeError(f"get_token returned {type(value).__name__}, not str or None")
    return value


def _ws_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` -> ``ws(s)://.../ws``; a ``ws(s)://`` URL is used as given."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a gateway URL (http, https, ws or wss): {url!r}")
    path = parts.path
    if parts.scheme in ("http", "https"):
        path = path.rstrip("/") + "/ws"
    return urlunsplit((scheme, parts.netloc, path or "/", parts.query, ""))


def _with_token(url: str, token: str | None) -> str:
    if token is None:
        return url
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "token"]
    return urlunsplit(parts._replace(query=urlencode([*query, ("token", token)])))


def _refusal(closed: ConnectionClosed) -> CloseInfo | None:
    """The close the client sent when it refused what the gateway sent (`REFUSAL_CODES`: 1009, a frame past
    ``max_frame_bytes``), if no close frame came back (a gateway still writing that frame does not answer)."""
    sent = closed.sent
    if closed.rcvd is None and sent is not None and sent.code in REFUSAL_CODES:
        return CloseInfo(sent.code, sent.reason)
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Subscription:
    """One topic's stream: ``async for event in sub`` yields `Message` and `Loss` events in order; a message
    never comes twice, and a seq that will never come is told by exactly one `Loss`.

    The iteration ends when the application ends the subscription (`unsubscribe`, or the client closed by
    `Client.close` / the end of ``async with``): what was still queued is dropped. When the gateway ends it,
    the queued events come first, then the iteration raises `FanoutError` whose ``code`` says why:
    ``deleted`` (an operator deleted the topic), ``taken_over`` (another connection of the user took this
    private queue), ``lost`` (with a broker, Redis lost this private queue), a gateway error code (a
    resubscribe refused, e.g. ``forbidden``), or ``closed`` (the gateway closed the client for good:
    ``close_code`` 4000, 4001, 4006, 4011).

    **The bound.** At most ``max_queued_events`` events wait for the application. When a message comes for a
    full queue:

    * ring and snapshot topics are *paused*: the client unsubscribes the topic at once (other topics and
      requests go on), and once the application has taken half the queue, subscribes it again with
      ``since`` = the next seq it needs. The gateway replays from its ring: nothing is lost while the ring
      still holds it, otherwise the gateway's own `Loss` (``gone``) gives the exact range. A snapshot topic
      gets its latest value (conflation). `pauses` counts these.
    * private topics (never lossy on the gateway) apply *back-pressure*: the client stops reading the
      connection until there is room. The gateway holds the entries (and its publishers, once its queue is
      full); past ``websocket.blocked_timeout_s`` it closes the connection with 4008, and the client
      reconnects and takes the queue over.
    """

    def __init__(self, client: Client, topic: str, since: Position | None, delta: str | None = None) -> None:
        self.client = client
        self.topic = topic
        #: ``delta="fossil"``: the base the topic's deltas apply to (fanout_client/fossil.py)
        self._delta = DeltaBase() if delta == "fossil" else None
        #: whether the gateway sends this subscription deltas (its last ``subscribed`` said so); None: not asked
        self.delta_granted: bool | None = None
        #: messages rebuilt from a delta, and deltas that failed (a resubscribe with ``since`` follows, after a backoff)
        self.deltas_applied = 0
        self.delta_failures = 0
        #: failed deltas since the last message that applied: the exponent of the resubscribe's backoff
        self._delta_retries = 0
        #: the resubscribe after a failed delta, waiting out that backoff (None: none waits)
        self._delta_retry: asyncio.TimerHandle | None = None
        self._stream = Stream(topic, since)
        self._queue: deque[Event] = deque()
        self._max = client.max_queued_events
        self._readable = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._paused = False
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: why the subscription ended (None while it is open): ``unsubscribed``, ``client_closed``, ``deleted``,
        #: ``taken_over``, ``lost``, ``error``
        self.closed_reason: str | None = None
        self._error: FanoutError | None = None
        #: `subscribed` answers so far (the first subscribe and each resubscribe)
        self.subscribed_count = 0
        #: times the queue was full and a ring or snapshot topic was paused (see the class docstring)
        self.pauses = 0
        #: private topics (acknowledged subscriptions): the highest seq of the current epoch handed to the
        #: application, the highest the current gateway subscription was handed, and the last ack sent on it
        self._handled = -1
        self._received = -1
        self._acked = -1

    # -- state --------------------------------------------------------------------------------------------

    @property
    def kind(self) -> TopicKind | None:
        """``ring``, ``snapshot`` or ``private``: known from the first ``subscribed``."""
        return self._stream.kind

    @property
    def epoch(self) -> str | None:
        return self._stream.epoch

    @property
    def next_seq(self) -> int | None:
        """The next seq this subscription needs."""
        return self._stream.next_seq

    @property
    def position(self) -> Position | None:
        """Where to resume: pass it as ``since`` to a later `Client.subscribe` (another process) to recover exactly."""
        return self._stream.position

    @property
    def queued(self) -> int:
        """Events waiting for the application."""
        return len(self._queue)

    # -- the application's side ----------------------------------------------------------------------------

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        while not self._queue:
            if self.closed_reason is not None:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._readable.clear()
            await self._readable.wait()
        event = self._queue.popleft()
        self._space.set()
        if isinstance(event, Message) and self._stream.kind == "private" and event.epoch == self._stream.epoch:
            self._handled = max(self._handled, event.seq)
            self._ack()
        if self._paused and len(self._queue) <= self._max // 2:
            self._paused = False
            if self._delta_retry is None:  # else its timer resubscribes
                self.client._resume(self)
        return event

    async def get(self, timeout: float | None = None) -> Event:
        """The next event (as ``async for`` would give it; at the end `StopAsyncIteration` or the error);
        `TimeoutError` after ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            return await self.__anext__()

    async def unsubscribe(self) -> None:
        """End the subscription (the iteration ends; queued events are dropped)."""
        if self.closed_reason is not None:
            return
        self.client._unsubscribe(self)
        self._end("unsubscribed", None, drop_queued=True)

    # -- the client's side ------------------------------------------------------------------------------------

    def _command(self, request_id: int) -> dict[str, Any]:
        command: dict[str, Any] = {"op": "subscribe", "topic": self.topic, "id": request_id}
        if self.client.private_ack:
            command["ack"] = True  # private topics: entries leave the queue on our ack (ignored by other kinds)
        position = self._stream.position
        if position is not None:
            command["since"] = {"epoch": position.epoch, "seq": position.seq}
        if self._delta is not None:
            command["delta"] = "fossil"
        return command

    def _data_of(self, entry: dict[str, Any]) -> Any:
        """A message's data; on a delta subscription rebuilt from the base (raises `DeltaError`)."""
        base = self._delta
        if base is None or "delta" not in entry:
            return entry.get("data")
        data = base.of_entry(entry)
        if entry["delta"] is True:
            self.deltas_applied += 1
        self._delta_retries = 0  # a message that applied: the next failure resubscribes quickly again
        return data

    @property
    def _held(self) -> bool:
        """Unsubscribed on purpose (a pause, or a resubscribe waiting out its backoff): no subscribe is sent and
        the gateway's ``subscribed`` entries for the topic are ignored."""
        return self._paused or self._delta_retry is not None

    def _delta_failed(self, error: DeltaError) -> None:
        """A delta did not apply: nothing is shown of it; unsubscribe, and subscribe again from the seq it was
        for (``since``: the gateway sends that message whole) after a delay of full jitter, doubling from
        ``backoff_base`` with each failure since the last message that applied, at most ``backoff_max``. What
        comes for the topic meanwhile is ignored, so one resubscribe answers any number of failures."""
        self.delta_failures += 1
        self.client._log.warning("fanout_client: a delta of %r did not apply (%s): resubscribing", self.topic, error)
        if self._delta is not None:
            self._delta.reset()
        self._stream.resubscribing()
        if self._held:
            return  # a resubscribe comes already
        self.client._pause(self)
        client = self.client
        delay = _full_jitter(self._delta_retries, client.backoff_base, client.backoff_max)
        self._delta_retries += 1
        self._delta_retry = asyncio.get_running_loop().call_later(delay, self._resubscribe_after_delta)

    def _resubscribe_after_delta(self) -> None:
        self._delta_retry = None
        if self.closed_reason is None and not self._paused:
            self.client._resume(self)  # without a connection, the next one subscribes it

    def _ack(self) -> None:
        """Acknowledge (cumulatively) what the application was handed, as far as this gateway subscription
        was handed it too (an ack past that is refused): once per loop turn and topic (`Outgoing.ack_soon`)."""
        upto = min(self._handled, self._received)
        if upto > self._acked and self.client.private_ack and self._stream.subscribed:
            self._acked = upto
            self.client._out.ack_soon(self.topic, upto)

    def _on_received(self, seq: int) -> None:
        """A private message of the current subscription (a redelivery too): it may be acknowledged now."""
        if self._stream.kind == "private" and self._stream.subscribed:
            self._received = max(self._received, seq)
            self._ack()

    def _on_subscribed(self, kind: str, epoch: str, seq: int) -> None:
        self.subscribed_count += 1
        if self._delta is not None:
            self._delta.reset()  # the gateway sends the next message whole
        if epoch != self._stream.epoch:
            self._handled = -1  # a new queue: seqs start again
        self._received = self._acked = seq - 1  # a new gateway subscription: everything below `seq` left
        if not self._ready.done():
            self._ready.set_result(None)
        self._push(self._stream.on_subscribed(kind, epoch, seq))

    def _push(self, events: list[Event]) -> None:
        if events:
            self._queue.extend(events)
            self._readable.set()

    def _room_for(self, count: int) -> bool:
        return len(self._queue) + count <= self._max

    async def _deliver(self, make: Callable[[], list[Event]]) -> None:
        """Queue the events ``make`` produces from one entry, under the bound (see the class docstring)."""
        if self.closed_reason is not None:
            return
        if self._stream.kind == "private":
            while not self._room_for(2) and self.closed_reason is None:
                self._space.clear()
                await self._space.wait()
            if self.closed_reason is not None:
                return
        elif self._held:
            return  # resumed later with `since`: the gateway replays it
        elif not self._room_for(2):  # a message may come with a `gap` loss before it
            self._paused = True
            self.pauses += 1
            self._stream.resubscribing()
            self.client._pause(self)
            return
        self._push(make())

    def _end(self, reason: str, error: FanoutError | None, *, drop_queued: bool = False) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        self._error = error
        if self._delta_retry is not None:
            self._delta_retry.cancel()
            self._delta_retry = None
        if drop_queued:
            self._queue.clear()
        if not self._ready.done():
            self._ready.set_exception(error or FanoutError("closed", f"the subscription ended ({reason})"))
        self._readable.set()
        self._space.set()


class Client:
    """A connection to the gateway that outlives its WebSocket connections. Make one with `connect`; use it as
    ``async with``, or call `start` and `close` yourself. Options: `connect`."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        get_token: TokenSource | None = None,
        connect_timeout: float = 10.0,
        ping_interval: float | None = 20.0,
        ping_timeout: float = 10.0,
        backoff_base: float = 0.5,
        backoff_max: float = 15.0,
        request_timeout: float = 10.0,
        max_pending_requests: int = 1000,
        max_queued_events: int = 10000,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        start_timeout: float | None = 30.0,
        on_state: Callable[[ClientState, CloseInfo | None], None] | None = None,
        on_error: Callable[[FanoutError], None] | None = None,
        private_ack: bool = True,
    ) -> None:
        if max_queued_events < 2:
            raise ValueError("max_queued_events must be at least 2 (a message and the loss before it)")
        self.url = _ws_url(url)
        #: the token of the next connection (the one `get_token` last gave, or ``token``)
        self.token = token
        self._get_token = get_token
        self.connect_timeout = connect_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.request_timeout = request_timeout
        self.max_pending_requests = max_pending_requests
        self.max_queued_events = max_queued_events
        self.max_frame_bytes = max_frame_bytes
        self.start_timeout = start_timeout
        #: subscribe with ``ack`` and acknowledge private messages once handed to the application, so that
        #: those written to a connection that died come again (at-least-once, duplicates dropped by seq)
        self.private_ack = private_ack
        self._on_state = on_state
        self._on_error = on_error
        self.state: ClientState = "connecting"
        #: connections made after the first one
        self.reconnects = 0
        #: how the last connection ended (None before the first ended)
        self.last_close: CloseInfo | None = None
        #: why the client closed, when the gateway (or a failure) closed it: a `FanoutError` ``closed``
        self.close_error: FanoutError | None = None
        #: the user and the expiry (Unix seconds) of the last token an ``auth`` refresh got accepted
        self.user: str | None = None
        self.expires_at: float | None = None
        self.subscriptions: dict[str, Subscription] = {}
        self._ws: ClientConnection | None = None
        self._need_token = token is None and get_token is not None
        #: the commands waiting for their answer (fanout_client/pending.py)
        self._table = PendingTable()
        #: the commands waiting for the next frame (fanout_client/outgoing.py)
        self._out = Outgoing(lambda: self._ws)
        #: the entries the gateway sends, read (`_EntryReader`)
        self._reader = _EntryReader(self)
        self._attempt = 0
        self._ever_connected = False
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._log = _LogBudget()

    # -- lifetime -------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Closed for good (by `close`, or by the gateway: `close_error`)."""
        return self.state == "closed"

    async def __aenter__(self) -> Client:
        self.start()
        if self.start_timeout is not None:
            try:
                await self.wait_connected(self.start_timeout)
            except BaseException:
                await self.close()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Connect in the background (and reconnect, until `close`). Called by ``async with``."""
        if self._task is not None:
            return
        self._out.start()
        self._changed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fanout-client")

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Until the client is connected (the gateway answered on a new connection). Raises the client's
        `FanoutError` ``closed`` if it closes first, `FanoutError` ``timeout`` after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while self.state != "connected":
                    if self.state == "closed":
                        raise self.close_error or FanoutError("closed", "the client is closed")
                    assert self._changed is not None, "start() the client first"
                    await self._changed.wait()
        except TimeoutError:
            raise FanoutError("timeout", f"not connected within {timeout} s (last close: {self.last_close})") from None

    async def wait_closed(self) -> FanoutError | None:
        """Until the client is closed; the error that closed it, None when the application did."""
        while self.state != "closed":
            assert self._changed is not None, "start() the client first"
            await self._changed.wait()
        return self.close_error

    async def close(self) -> None:
        """Close for good: no reconnect; waiting requests fail with ``closed``; subscriptions end."""
        self._terminate(CloseInfo(1000, "closed by the application"), by_gateway=False)
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await ws.close(1000, "client closed")
        tasks = [t for t in (self._task, *self._out.tasks) if t is not None and t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._log.flush()

    # -- requests ---------------------------------------------------------------------------------------------

    async def subscribe(self, topic: str, since: Position | None = None, *, delta: str | None = None) -> Subscription:
        """Subscribe to ``topic`` and return the `Subscription` once the gateway acknowledged it (waiting for a
        connection if there is none, at most ``request_timeout``). ``since`` resumes from a saved position.
        ``delta="fossil"``: the gateway may send messages as deltas of the one before, where the topic allows
        (`Subscription.delta_granted`); they are applied here and checked, so the events are the same.
        Raises `FanoutError`: the gateway's refusal (``forbidden``, ``unknown_topic``, ...), ``timeout``,
        ``already_subscribed`` (one subscription per topic), ``closed``."""
        self._check_open()
        existing = self.subscriptions.get(topic)
        if existing is not None and existing.closed_reason is None:
            raise FanoutError("already_subscribed", f"this client already has a subscription to {topic!r}")
        if delta not in (None, "fossil"):
            raise ValueError(f'delta must be "fossil" or None, not {delta!r}')
        sub = Subscription(self, topic, since, delta)
        self.subscriptions[topic] = sub
        if self._ws is not None:
            self._send_subscribe(sub)
        try:
            async with asyncio.timeout(self.request_timeout):
                await asyncio.shield(sub._ready)
        except TimeoutError:
            self._abandon(sub)
            raise FanoutError("timeout", f"no answer to the subscribe in {self.request_timeout} s") from None
        except asyncio.CancelledError:
            self._abandon(sub)
            raise
        return sub

    async def publish(self, topic: str, data: Any) -> int:
        """Publish to a topic that takes client publishes; returns the seq the gateway gave the message.
        A `FanoutError` ``disconnected`` means the publish may have landed."""
        result = await self._request({"op": "publish", "topic": topic, "data": data})
        seq = _int(result.get("seq")) if isinstance(result, dict) else None
        if seq is None:
            raise FanoutError("bad_reply", f"a publish answered {result!r}")
        return seq

    async def rpc(self, method: str, params: Any = None) -> Any:
        """Call an rpc method (``echo``, ``time``, ``topics``, ``whoami``); returns its result."""
        return await self._request({"op": "rpc", "method": method, "params": params})

    async def _request(self, command: dict[str, Any]) -> Any:
        self._check_open()
        table = self._table
        if table.requests >= self.max_pending_requests:
            raise FanoutError("queue_full", f"{self.max_pending_requests} requests already wait for an answer")
        request_id = table.new_id()
        command["id"] = request_id
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        table.pending[request_id] = Pending("request", future=future, command=command)
        table.requests += 1
        try:
            if self._ws is not None:
                self._out.send_soon(command)
            else:
                table.outbox[request_id] = None
            async with asyncio.timeout(self.request_timeout):
                return await future
        except TimeoutError:
            raise FanoutError("timeout", f"no answer in {self.request_timeout} s") from None
        finally:
            table.requests -= 1
            table.pending.pop(request_id, None)
            table.outbox.pop(request_id, None)

    def _check_open(self) -> None:
        if self._task is None:
            raise RuntimeError("start() the client first (or use it as `async with`)")
        if self.state == "closed":
            raise self.close_error or FanoutError("closed", "the client is closed")

    def _send_subscribe(self, sub: Subscription) -> None:
        request_id = self._table.new_control(Pending("subscribe", sub=sub), sub.topic)
        sub._stream.resubscribing()
        self._out.send_soon(sub._command(request_id))

    def _unsubscribe(self, sub: Subscription) -> None:
        if self.subscriptions.get(sub.topic) is sub:
            del self.subscriptions[sub.topic]
        if self._ws is not None and not sub._held:
            self._send_unsubscribe(sub)

    def _send_unsubscribe(self, sub: Subscription) -> None:
        request_id = self._table.new_control(Pending("unsubscribe", sub=sub), sub.topic)
        self._out.send_soon({"op": "unsubscribe", "topic": sub.topic, "id": request_id})

    def _abandon(self, sub: Subscription) -> None:
        """A subscribe the caller gave up on (timeout, cancelled): end it on both sides."""
        if sub.closed_reason is None:
            self._unsubscribe(sub)
        sub._ready.cancel()
        sub._end("unsubscribed", None, drop_queued=True)

    def _pause(self, sub: Subscription) -> None:
        """Stop the topic's flow: ``sub``'s queue is full (ring or snapshot) until the application catches up,
        or a delta did not apply until the backoff's resubscribe."""
        if self._ws is not None:
            self._send_unsubscribe(sub)

    def _resume(self, sub: Subscription) -> None:
        """``sub``'s queue has room again: subscribe from where it stopped (without a connection, the next
        connection resubscribes it)."""
        if self._ws is not None and sub.closed_reason is None:
            self._send_subscribe(sub)

    # -- the connection loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self.closed:
            if self._need_token:
                try:
                    token = await _ask_token(self._get_token)
                except Exception as exc:  # noqa: BLE001 - the application's function: reported, retried
                    self._report(FanoutError("token", f"get_token failed: {exc!r}"))
                    await self._backoff(CloseInfo(1006, "get_token failed"))
                    continue
                self._need_token = False
                if token:
                    self.token = token
            self._set_state("connecting", None)
            try:
                ws = await ws_connect(
                    _with_token(self.url, self.token),
                    open_timeout=self.connect_timeout,
                    ping_interval=self.ping_interval,
                    ping_timeout=self.ping_timeout,
                    close_timeout=CLOSE_TIMEOUT_S,
                    max_size=self.max_frame_bytes,
                    max_queue=RECEIVE_QUEUE_FRAMES,
                    compression=None,
                    create_connection=_GuardedConnection,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - refused, reset, timed out, an HTTP answer (403, 503): retried
                await self._backoff(CloseInfo(1006, f"cannot connect: {exc}"))
                continue
            if self.closed:
                await ws.close(1000, "client closed")
                return
            assert isinstance(ws, _GuardedConnection)  # create_connection
            close, lived = await self._serve(ws)
            self.last_close = close
            self._drop_connection_state()
            if self.closed:
                return
            if lived >= STABLE_S:
                self._attempt = 0
            if await self._may_reconnect(close):
                await self._backoff(close)

    async def _serve(self, ws: _GuardedConnection) -> tuple[CloseInfo, float]:
        """Read the connection until it ends; how it ended and how long it lived."""
        opened_at = time.monotonic()
        self._ws = ws
        # The opening frame: a ping (its answer makes the client `connected`: the gateway accepted us; a refused
        # token is closed before it), every subscription to restore, the requests that waited.
        table = self._table
        open_id = table.new_control(Pending("open"))
        commands: list[dict[str, Any]] = [{"op": "ping", "id": open_id}]
        for sub in self.subscriptions.values():
            if sub.closed_reason is None and not sub._held:
                request_id = table.new_control(Pending("subscribe", sub=sub), sub.topic)
                sub._stream.resubscribing()
                commands.append(sub._command(request_id))
        for request_id in list(table.outbox):
            pending = table.pending.get(request_id)
            if pending is not None and pending.command is not None:
                commands.append(pending.command)
        table.outbox.clear()
        assert self._out.lock is not None
        try:
            async with self._out.lock:
                await self._out.write(ws, commands)
            while True:
                frame = await ws.recv(decode=False)  # the text frame's UTF-8 bytes, as orjson takes them
                try:
                    entries = orjson.loads(frame)
                except orjson.JSONDecodeError:
                    await ws.close(1007, "a frame that is not JSON")
                    break
                if isinstance(entries, list):
                    await self._reader.batch(entries)
        except ConnectionClosed as closed:
            refused = _refusal(closed)
            if refused is not None:
                return refused, time.monotonic() - opened_at
        finally:
            self._ws = None
        code = int(ws.close_code) if ws.close_code is not None else 1006  # None, or 1006: no close frame came
        return CloseInfo(code, ws.close_reason or ws.dropped_because or ""), time.monotonic() - opened_at

    async def _may_reconnect(self, close: CloseInfo) -> bool:
        """The close-code table of docs/client.md: whether to reconnect (False: the client is closed)."""
        if close.code in TERMINAL:
            self._terminate(close, by_gateway=True)
            return False
        if close.code in (4001, 4011):
            if self._get_token is None:
                self._terminate(close, by_gateway=True)
                return False
            self._set_state("disconnected", close)
            previous = self.token
            try:
                token = await _ask_token(self._get_token)
            except Exception as exc:  # noqa: BLE001 - the application's function: reported, retried
                self._report(FanoutError("token", f"get_token failed: {exc!r}"))
                return True
            if self.state == "closed":
                return False
            if not token or (close.code == 4001 and token == previous):
                self._terminate(close, by_gateway=True)
                return False
            self.token = token
        return True

    async def _backoff(self, close: CloseInfo) -> None:
        """Full jitter: a delay uniform in [0, min(backoff_max, backoff_base * 2^attempt)). After a drain's 1012,
        at least the delay the gateway hinted (it spread its clients' reconnects), at most `backoff_max`: a hint
        lengthens the delay, never shortens it, so a gateway closing 1012 "reconnect in 0 ms" again and again
        is retried ever more slowly, like any other."""
        if self.state == "closed":
            return
        self.last_close = close
        self._set_state("disconnected", close)
        delay = _full_jitter(self._attempt, self.backoff_base, self.backoff_max)
        self._attempt += 1
        hint = restart_hint_s(close.code, close.reason)
        if hint is not None:
            delay = min(self.backoff_max, max(hint, delay))
        await asyncio.sleep(delay)

    def _drop_connection_state(self) -> None:
        self._out.wire = []
        self._table.connection_lost()
        for sub in self.subscriptions.values():
            sub._stream.resubscribing()

    def _terminate(self, close: CloseInfo, *, by_gateway: bool) -> None:
        if self.state == "closed":
            return
        error = FanoutError("closed", close.reason or f"closed with {close.code}", close_code=close.code)
        if by_gateway:
            self.close_error = error
            self.last_close = close
        self._drop_connection_state()
        self._table.close(error)
        self.state = "closed"
        if by_gateway:
            self._report(error)
        self._notify(close)
        subs = list(self.subscriptions.values())
        self.subscriptions.clear()
        for sub in subs:
            sub._end("client_closed", error if by_gateway else None, drop_queued=not by_gateway)

    def _set_state(self, state: ClientState, close: CloseInfo | None) -> None:
        if self.state == state or self.state == "closed":
            return
        self.state = state
        self._notify(close)

    def _notify(self, close: CloseInfo | None) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()
        if self._on_state is not None:
            try:
                self._on_state(self.state, close)
            except Exception:
                log.exception("fanout_client: the on_state handler failed")

    def _report(self, error: FanoutError) -> None:
        if self._on_error is None:
            self._log.warning("fanout_client: %s", error)
            return
        try:
            self._on_error(error)
        except Exception:
            self._log.warning("fanout_client: the on_error handler failed", exc_info=True)

    def _opened(self) -> None:
        """The answer to the opening ping: the gateway accepted this connection."""
        if self._ever_connected:
            self.reconnects += 1
        self._ever_connected = True
        self._set_state("connected", None)


class _EntryReader:
    """The entries a `Client`'s connection brings, each where it goes: a subscription's messages, losses and
    ends, the answers of the commands waiting (`PendingTable`), the errors no command owns."""

    __slots__ = ("client", "_refreshing")

    def __init__(self, client: Client) -> None:
        self.client = client
        #: a ``token_expired`` refresh is running (`_refresh_token`): one at a time
        self._refreshing = False

    async def batch(self, entries: list[Any]) -> None:
        client = self.client
        for entry in entries:
            if client._ws is None or client.state == "closed":
                return
            if not isinstance(entry, dict):
                continue
            kind = entry.get("type")
            topic = entry.get("topic")
            sub = client.subscriptions.get(topic) if isinstance(topic, str) else None
            if kind == "msg":
                seq = _int(entry.get("seq"))
                if sub is not None and seq is not None:
                    try:
                        data = sub._data_of(entry) if sub._stream.subscribed else None
                    except DeltaError as exc:
                        sub._delta_failed(exc)
                        continue
                    await sub._deliver(partial(sub._stream.on_msg, seq, data))
                    sub._on_received(seq)
            elif kind == "loss":
                start, end, reason = _int(entry.get("from")), entry.get("to"), entry.get("reason")
                if sub is not None and start is not None and (end is None or _int(end) is not None):
                    why = reason if isinstance(reason, str) else "gone"
                    await sub._deliver(partial(sub._stream.on_loss, start, _int(end), why))
            elif kind == "subscribed":
                self._subscribed(entry, sub)
            elif kind == "unsubscribed":
                client._table.settle(entry.get("id"))
            elif kind == "closed":
                if sub is not None:
                    del client.subscriptions[sub.topic]
                    reason = entry.get("reason")
                    reason = reason if isinstance(reason, str) else "closed"
                    sub._end(reason, FanoutError(reason, f"the gateway ended the subscription to {sub.topic!r}"))
            elif kind == "reply":
                self._reply(entry)
            elif kind == "error":
                self._error(entry)
            # any other type: a newer gateway's entry, ignored

    def _subscribed(self, entry: dict[str, Any], sub: Subscription | None) -> None:
        request_id = entry.get("id")
        asked = self.client._table.settle(request_id)
        if asked is None and request_id is not None:
            return  # the answer to a subscribe replaced since (`PendingTable.new_control`), or to none of ours
        # the subscription that asked (an earlier one of the same topic may have been replaced since); `id`
        # null: the gateway's own, after an epoch change under a live subscription (with a broker)
        target = asked.sub if asked is not None and asked.kind == "subscribe" else sub
        kind, epoch, seq = entry.get("kind"), entry.get("epoch"), _int(entry.get("seq"))
        if target is None or target is not sub or sub.closed_reason is not None or sub._held:
            return
        if isinstance(kind, str) and isinstance(epoch, str) and seq is not None:
            if "delta" in entry:
                sub.delta_granted = entry["delta"] is True
            sub._on_subscribed(kind, epoch, seq)

    def _reply(self, entry: dict[str, Any]) -> None:
        client = self.client
        pending = client._table.settle(entry.get("id"))
        if pending is None:
            return
        result = entry.get("result")
        if pending.kind == "open":
            client._opened()
        elif pending.kind == "auth":
            if pending.token is not None:
                client.token = pending.token
            if isinstance(result, dict):
                user, expires = result.get("user"), result.get("expires_at")
                client.user = user if isinstance(user, str) else None
                client.expires_at = _number(expires)
        elif pending.future is not None and not pending.future.done():
            pending.future.set_result(result)

    def _error(self, entry: dict[str, Any]) -> None:
        client = self.client
        code, message = entry.get("code"), entry.get("message")
        error = FanoutError(code if isinstance(code, str) else "error", message if isinstance(message, str) else "")
        pending = client._table.settle(entry.get("id"))
        if pending is None:
            if error.code == "token_expired":
                if not self._refreshing:
                    self._refreshing = True
                    client._out.spawn(self._refresh_token())
                return
            client._report(error)
            return
        if pending.kind == "request":
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
        elif pending.kind == "subscribe" and pending.sub is not None:
            if error.code == "already_subscribed":
                return
            sub = pending.sub
            if client.subscriptions.get(sub.topic) is sub:
                del client.subscriptions[sub.topic]
            sub._end("error", error)
        elif pending.kind in ("unsubscribe", "open"):
            return  # not_subscribed after a pause: nothing to stop
        else:
            client._report(error)  # an `auth` refused: the gateway closes with 4011, then get_token is asked again

    async def _refresh_token(self) -> None:
        """``token_expired`` on a live connection: a fresh token with ``auth`` before ``auth.expired_grace_s``."""
        client = self.client
        try:
            if client._get_token is None:
                client._report(FanoutError("token_expired", "the token expired and there is no get_token"))
                return
            try:
                token = await _ask_token(client._get_token)
            except Exception as exc:  # noqa: BLE001 - the application's function: reported
                client._report(FanoutError("token", f"get_token failed: {exc!r}"))
                return
            if not token:
                client._report(FanoutError("token_expired", "the token expired and get_token gave none"))
                return
            if client._ws is not None:
                request_id = client._table.new_control(Pending("auth", token=token))
                client._out.send_soon({"op": "auth", "token": token, "id": request_id})
            else:
                client.token = token
        finally:
            self._refreshing = False


def connect(
    url: str,
    *,
    token: str | None = None,
    get_token: TokenSource | None = None,
    connect_timeout: float = 10.0,
    ping_interval: float | None = 20.0,
    ping_timeout: float = 10.0,
    backoff_base: float = 0.5,
    backoff_max: float = 15.0,
    request_timeout: float = 10.0,
    max_pending_requests: int = 1000,
    max_queued_events: int = 10000,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    start_timeout: float | None = 30.0,
    on_state: Callable[[ClientState, CloseInfo | None], None] | None = None,
    on_error: Callable[[FanoutError], None] | None = None,
    private_ack: bool = True,
) -> Client:
    """A `Client` of the gateway at ``url`` (its base ``http(s)://`` URL, or the ``ws(s)://.../ws`` URL), to use
    as ``async with connect(...) as client``. Options (docs/client.md, "The Python client: fanout_client"):

    * ``token``: a JWT, sent as ``?token=``; ``get_token``: a function (or coroutine function) giving one, asked
      before the first connection when ``token`` is None, when the token expires (the new one is sent with
      ``auth`` on the live connection) and on the close codes 4001 and 4011;
    * ``connect_timeout``: seconds for one connection's opening handshake; ``ping_interval``,
      ``ping_timeout``: WebSocket pings (None: none), no pong in time drops the connection (1006) and re-makes it;
    * ``backoff_base``, ``backoff_max``: the reconnect delays' cap, doubling from ``backoff_base`` (full jitter);
    * ``request_timeout``: seconds for `Client.publish`, `Client.rpc` and `Client.subscribe` (``timeout``);
    * ``max_pending_requests``: requests waiting for an answer or a connection (beyond: ``queue_full``);
    * ``max_queued_events``: each subscription's queue (policy: `Subscription`);
    * ``max_frame_bytes``: the largest frame accepted from the gateway (a larger one drops the connection, 1009;
      the default, 2 MiB, is near the largest a gateway with the default config builds, ~1.07 MiB);
    * ``start_timeout``: how long ``async with`` waits for the first connection (None: it does not wait);
    * ``on_state(state, close)``, ``on_error(error)``: callbacks (state changes; errors no request owns).
    * ``private_ack``: subscribe private topics with ``ack`` and acknowledge each message once handed to the
      application (cumulative, one ack per topic and loop turn): what a dying connection had in flight comes
      again on the next one, duplicates dropped by seq. False: entries leave the queue once written.
    """
    return Client(
        url,
        token=token,
        get_token=get_token,
        connect_timeout=connect_timeout,
        ping_interval=ping_interval,
        ping_timeout=ping_timeout,
        backoff_base=backoff_base,
        backoff_max=backoff_max,
        request_timeout=request_timeout,
        max_pending_requests=max_pending_requests,
        max_queued_events=max_queued_events,
        max_frame_bytes=max_frame_bytes,
        start_timeout=start_timeout,
        on_state=on_state,
        on_error=on_error,
        private_ack=private_ack,
    )
