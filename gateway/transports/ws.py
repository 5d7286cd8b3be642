"""WebSocket transport: our own subclass of uvicorn's sans-I/O websockets protocol serves `/ws` itself.

Past the HTTP layer (connection limits, header deadline: gateway/netguard.py) the protocol answers the
handshake of `/ws` itself (Origin, `?id=`, `?token=`), registers the connection with the hub, and hands each
command frame to `gateway/commands.py` as it is parsed: no ASGI task, receive queue or scope per
connection, which is most of what an idle connection would otherwise hold (docs/benchmarks-history.md,
"Idle clients"). The scheduler writes each batch as one pre-built text frame straight to the transport, never
awaiting: a client whose transport buffer is above the high-water mark is not ready until asyncio calls
`resume_writing` (below a quarter of it). Per-message compression is off: it would force an encode per client.
With `websocket.direct_write = false` (a shipped setting, "for comparison": docs/benchmarks-history.md measures
the two write paths) `/ws` is the Starlette endpoint below, `websocket_endpoint`, and writes go through ASGI
`send` from a writer task. It is the only other way `/ws` is served (the gateway always runs this protocol,
gateway/server.py, and so do the test gateways, gateway/testing.py), and it shares everything but the I/O
with the protocol's: the handshake (`open_ws_client`, gateway/transports/handshake.py), the command path
(`run_frame`) and the connection (`WSConnection`); the frame-level bounds (fragments, pongs, UTF-8,
protocol errors) are this protocol's on both, the Origin check the app's middleware there (same 403).
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Literal
from urllib.parse import parse_qs

from prometheus_client.core import CounterMetricFamily, Metric
from starlette.websockets import WebSocket
from uvicorn._types import ASGIReceiveEvent
from uvicorn.config import Config
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.extensions import Extension
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import Event, Protocol
from websockets.server import ServerProtocol
from websockets.streams import StreamReader

from core import Batch, RequestError

from .. import close_codes
from ..commands import handle_payload
from ..fanwrite import raw_fd
from ..hub import Hub
from ..identity import ClientIdentity
from ..netguard import FALLBACK_BAD_INPUT, ConnectionLimiter
from ..origin import OriginPolicy
from ..ratelog import BadInputLog
from ..timerwheel import TimerWheel
from .handshake import Admission, admit, close_reason
from .staging import StagedWriter, peer_acked_within, tune_stream
from .wsframes import text_frame_header

log = logging.getLogger("gateway.ws")

#: how long a kicked client's buffered data and close frame may take to drain before the cut
KICK_GRACE_S = 2.0
#: the route the protocol serves itself
WS_PATH = "/ws"
#: bytes handed to the frame parser at a time, one step of `_handle_input`: a peer's protocol error (too many
#: fragments) is seen after at most this much of a read, and a slice of the smallest frames (2,700 pings in
#: 16 KiB: ~7 ms) takes ~2 ms to parse
PARSE_SLICE = 4096
#: bytes a lingering connection is read for (and dropped) before it is not read any more
LINGER_READ = 16384
#: CPU time one connection's input (parsing its frames, running its commands) may take of a turn of the event
#: loop, and all the connections' input together (`InputTurn`): the rest of what a connection sent waits for
#: the next turn, its reading paused meanwhile. Without it, a burst of commands (8 connections, each read
#: holding 5 frames of 60 `auth`) took ~25 ms per turn and /healthz of another client waited 64-84 ms at p99
#: (issue 24). A step (a slice parsed, one frame's commands run, ~0.2 ms for 100 cheap ones) is not cut, and
#: each connection with input takes at least one step per turn, so none waits behind the others for long.
TURN_BUDGET_S = 0.00025
TURN_BUDGET_ALL_S = 0.001


class InputTurn:
    """The time the WebSocket connections of one server may spend on their input in one turn of the event
    loop together (`TURN_BUDGET_ALL_S`); the turn is over when the callback it schedules runs (the next turn),
    as the ingest's `LoopTurn` (gateway/transports/ingest.py)."""

    __slots__ = ("budget", "deadline")

    def __init__(self, budget: float = TURN_BUDGET_ALL_S) -> None:
        self.budget = budget
        #: when this turn's budget is spent; None: no input was handled yet in this turn
        self.deadline: float | None = None

    def until(self, now: float) -> float:
        deadline = self.deadline
        if deadline is None:
            deadline = self.deadline = now + self.budget
            asyncio.get_running_loop().call_soon(self._next_turn)
        return deadline

    def _next_turn(self) -> None:
        self.deadline = None


class WSCounters:
    """Per-process counts of the frame-level bounds, for /metrics (gateway/metrics.py)."""

    #: pongs not written because a later ping came while the peer's writes were paused (one waits)
    pongs_coalesced = 0
    #: connections closed for fragmenting a message into more than `websocket.max_fragments` frames
    fragment_closes = 0
    #: times a connection's input was left for the next turn of the loop (its budget, or the turn's, spent)
    input_deferrals = 0
    #: keepalive pings not sent: frames flowed since the last one and the peer's TCP acknowledged within the interval
    pings_skipped = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("fanout_ws_pongs_coalesced", "pongs not written: a later ping came while the"
                                  " client's writes were paused (one pong waits)", value=self.pongs_coalesced)
        yield CounterMetricFamily("fanout_ws_fragment_closes", "connections closed (1008) for a message in more"
                                  " than websocket.max_fragments frames", value=self.fragment_closes)
        yield CounterMetricFamily("fanout_ws_pings_skipped", "keepalive pings not sent: frames flowed since the last"
                                  " one and the peer's TCP acknowledged within the interval", value=self.pings_skipped)
        yield CounterMetricFamily("fanout_ws_input_deferrals", "times a WebSocket client's input was left for the"
                                  " next turn of the event loop (its share of the turn spent)",
                                  value=self.input_deferrals)


ws_counters = WSCounters()


class _Discard:
    """Where uvicorn's own handlers put ASGI events once no ASGI app reads them (a served connection)."""

    def put_nowait(self, event: object) -> None:
        pass


DISCARD = _Discard()


class _WriteState(asyncio.Event):
    """`writable` of a connection that no ASGI `send` awaits: which of the two shared instances it is says
    whether its writes are paused (`pause_writing` swaps them), so a served connection holds no event, no
    waiters; uvicorn's own `set` and `clear` of it do nothing. The ASGI path gets a real event."""

    def __init__(self, state: bool) -> None:  # no waiters: nobody awaits it
        self.state = state

    def is_set(self) -> bool:
        return self.state

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass

    async def wait(self) -> Literal[True]:
        raise RuntimeError("a served WebSocket has no ASGI send")


WRITABLE = _WriteState(True)
PAUSED = _WriteState(False)
#: a served connection's `frames` between messages (uvicorn's handlers make a list when a message starts)
NO_FRAMES: tuple[bytes, ...] = ()
#: websockets' negotiated extensions of a connection that has none
NO_EXTENSIONS: tuple[Extension, ...] = ()
UVICORN_ERROR = logging.getLogger("uvicorn.error")
#: the frame parser waits for the next frame here, nothing of one read yet (`_park_parser`)
_AT_EOF = StreamReader.at_eof.__code__

#: what a connection's deadline on the keepalive wheel is: the next ping, or the pong of the last one
PING, PONG = 0, 1


def keepalive_due(proto: FanoutWSProtocol, due: int) -> None:
    if due == PING:
        proto.send_keepalive_ping()
    else:
        proto.keepalive_timeout()


#: the keepalive wheel's longest tick. Connections made together ping together, and a tick fires its pings
#: in one callback: at a second, a crowd of 10,000 made within 3 s sent ~3,300 pings in one go (~60 ms
#: with nothing else running, once per ping interval); at 50 ms a tick holds a twentieth of that.
KEEPALIVE_TICK_S = 0.05


def keepalive_resolution(interval: float | None, timeout: float | None) -> float:
    """The keepalive wheel's tick: `KEEPALIVE_TICK_S`, or a twentieth of the shorter of the ping interval and
    timeout (a ping or its timeout is then at most 5% late)."""
    periods = [p for p in (interval, timeout) if p is not None and p > 0]
    return min([KEEPALIVE_TICK_S, *(p / 20 for p in periods)])


class _FramedCache:
    """The WebSocket frame of the last payload: the clients of one cycle mostly get the same payload object
    in a row, so header and payload are joined once for all of them and each write is one buffer."""

    __slots__ = ("payload", "frame")

    def __init__(self) -> None:
        self.payload = b""
        self.frame = text_frame_header(0)

    def update(self, payload: bytes) -> None:
        self.frame = text_frame_header(len(payload)) + payload
        self.payload = payload


#: holds one payload and its frame (the last one written) until the next payload replaces them
framed = _FramedCache()


class FanoutWSProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, serving `/ws` itself (`handle_connect`). What each override of
    uvicorn's methods is for (the rest of uvicorn's protocol runs as it is; each override says more):

    - `connection_made`: client sockets get the write high-water mark, SO_SNDBUF and TCP_NOTSENT_LOWAT.
    - `pause_writing`, `resume_writing`: a connection is not ready while its writes are paused (the
      scheduler and the slow-consumer watchdog see it); a pong held meanwhile goes out on resume.
    - `handle_connect`: serves `/ws` without ASGI (Origin, handshake, registration); other paths, and `/ws`
      disabled or with `direct_write` off, go to uvicorn's and the ASGI app.
    - `data_received`, `handle_events`: input handled in turns (`_handle_input`, `InputTurn`), dropped while
      lingering; websockets' own refusal of a request is answered (`_refused_by_websockets`).
    - `handle_ping`: at most one pong waits while writes are paused (uvicorn's held every pong).
    - `handle_cont`: `websocket.max_fragments`.
    - `send_receive_event_to_app`: invalid UTF-8 is a 1007 close, not an ERROR traceback per frame; a served
      connection's message goes to `run_frame`.
    - `handle_parser_exception`: a peer's protocol error is counted and logged at a bounded rate; the close
      lingers (`linger_close`).
    - `keepalive_timeout`: close frame, then linger and cut (uvicorn's waited for a buffer that a peer that
      does not read never drains).
    - `handle_close`, `connection_lost`: a served client is unregistered (no ASGI task does it); the
      connection's slot of the HTTP port's limits is released.
    """

    # What one connection holds is in `__slots__` (an idle subscriber's memory, docs/benchmarks.md): uvicorn's
    # per-connection state that a served connection writes, and ours. What every connection of one server
    # shares alike (uvicorn's constructor copies it into each) is on the class (`_share`); uvicorn's state that
    # only the ASGI path writes (its queue, timers of a close, scope) has a class default and goes to the
    # instance's dict on that path only; the keepalive deadlines are on one timer wheel per server.
    __slots__ = (
        # uvicorn's
        "transport", "server", "client", "scheme", "conn", "writable", "handshake_initiated", "handshake_complete",
        "close_sent", "disconnected", "frames", "curr_msg_data_type", "pending_ping_payload", "ping_sent_at",
        "last_ping_rtt",
        # ours
        "connection", "served", "held_pong", "lingering", "dropped", "unparsed", "unhandled", "deferred", "raw_fd",
        "frames_at_ping",
    )

    write_high_water = 65536
    #: SO_SNDBUF of client sockets; 0 keeps the kernel's (auto-tuned, several MiB on loopback)
    socket_send_buffer = 0
    #: TCP_NOTSENT_LOWAT of client sockets: unsent bytes the kernel takes per connection; 0 keeps the kernel's
    notsent_lowat = 0
    #: the HTTP port's connection accounting: an upgraded connection holds its slot until it is lost here
    limiter: ConnectionLimiter | None = None
    #: where a peer's protocol errors are counted, and logged at a bounded rate (the hub's)
    bad_input: BadInputLog = FALLBACK_BAD_INPUT
    #: the hub, when the protocol serves `/ws` itself (set by `protocol_class`); None: every path goes to ASGI
    hub: Hub | None = None
    origins: OriginPolicy | None = None
    #: frames one message may take without a hub (with one: `websocket.max_fragments`); more: close 1008
    max_fragments = 64
    #: the turn's budget shared by this server's connections (`protocol_class` makes one per server)
    turn: InputTurn | None = None
    #: the keepalive deadlines of this class's connections (ping due, pong due): made by its first connection
    keepalive: TimerWheel[FanoutWSProtocol, int]
    #: the server whose shared state is on the class (`_share`)
    shared_by: ServerState | None = None

    # uvicorn's state that a served connection never writes (the ASGI path does: then in the instance's dict)
    queue: asyncio.Queue[ASGIReceiveEvent] = DISCARD  # type: ignore[assignment]  # only ASGI's queue is read
    close_timer = None
    close_timeout = 10.0
    initial_response = None
    read_paused = False
    ping_timer = None  # keepalive deadlines are on `keepalive`
    pong_timer = None

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        # uvicorn's constructor, less what the connections share (`_share`) and the ASGI path's state
        if not config.loaded:
            config.load()  # pragma: no cover
        self._share(config, server_state, app_state, _loop or asyncio.get_event_loop())
        self.transport = None  # type: ignore[assignment]  # set by connection_made, as uvicorn's
        self.server = self.client = None
        self.scheme = "ws"
        self.writable = WRITABLE
        self.handshake_initiated = self.handshake_complete = self.close_sent = self.disconnected = False
        extensions = None  # websockets takes None for none (uvicorn's empty list was one more per connection)
        if config.ws_per_message_deflate:
            extensions = [ServerPerMessageDeflateFactory(server_max_window_bits=12, client_max_window_bits=12,
                                                         compress_settings={"memLevel": 5})]
        self.conn = ServerProtocol(extensions=extensions, max_size=config.ws_max_size, logger=self.logger)
        self.frames = NO_FRAMES  # type: ignore[assignment]  # a message's list is made when one comes
        self.curr_msg_data_type = "bytes"
        self.pending_ping_payload = None
        self.ping_sent_at = self.last_ping_rtt = 0.0
        self.connection: WSConnection | None = None
        #: this connection is served here, not by an ASGI task
        self.served = False
        #: the pong answering the peer's latest ping, held while our writes are paused (at most one waits,
        #: RFC 6455 §5.5.3); reading is paused with it, so a peer that pings and never reads is not read either
        self.held_pong: bytes | None = None
        #: our close frame is sent: what the peer still sends is read and dropped until it closes
        self.lingering = False
        #: bytes read and dropped while lingering
        self.dropped = 0
        #: the part of the last read not fed to the parser yet, and the parsed events not handled yet: what is
        #: left when a turn's `TURN_BUDGET_S` is spent (at most one read; the peer is not read while they wait)
        self.unparsed: memoryview | None = None
        self.unhandled: deque[Event] | None = None
        #: `_handle_input` is scheduled for the next turn (reading is paused until it is done)
        self.deferred = False
        #: the socket's descriptor when the fan-out writer may write it directly (plain TCP), else -1
        self.raw_fd = -1

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:  # type: ignore[override]
        """The server's current headers (uvicorn's server replaces them each second, for their `date`)."""
        assert self.shared_by is not None
        return self.shared_by.default_headers

    def _share(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
               loop: asyncio.AbstractEventLoop) -> None:
        """What uvicorn's constructor gives each connection alike goes on the class, once, with the server's
        keepalive wheel; a connection of another server using the class (none in the gateway) gets it on its
        instance, as uvicorn's, and a wheel of its own."""
        shared = {"config": config, "app": config.loaded_app, "loop": loop, "logger": UVICORN_ERROR,
                  "root_path": config.root_path, "asgi_version": config.asgi_version, "app_state": app_state,
                  "connections": server_state.connections, "tasks": server_state.tasks,
                  "ping_interval": config.ws_ping_interval,
                  "ping_timeout": config.ws_ping_timeout}
        cls = type(self)
        if "shared_by" not in cls.__dict__:
            for name, value in shared.items():
                setattr(cls, name, value)
            cls.shared_by = server_state
            cls.keepalive = TimerWheel(keepalive_due, keepalive_resolution(config.ws_ping_interval,
                                                                          config.ws_ping_timeout))
        if any(getattr(cls, name) is not value for name, value in shared.items()) or cls.shared_by is not server_state:
            for name, value in shared.items():
                setattr(self, name, value)
            self.shared_by = server_state
            self.keepalive = TimerWheel(keepalive_due, keepalive_resolution(config.ws_ping_interval,
                                                                           config.ws_ping_timeout))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # always a stream
        # uvicorn's, then our socket and flow-control settings (the SSE stream's are the same, sse.py)
        super().connection_made(transport)
        tune_stream(transport, self.write_high_water, self.socket_send_buffer, self.notsent_lowat)
        self.raw_fd = raw_fd(transport)
        self.frames_at_ping = 0

    def pause_writing(self) -> None:
        # uvicorn's (its ASGI `send` waits on the event), and the served connection is not ready until
        # `resume_writing`
        if self.writable is WRITABLE:
            self.writable = PAUSED
        else:
            super().pause_writing()
        if self.connection is not None:
            self.connection.on_pause()

    def resume_writing(self) -> None:
        # uvicorn's, the pong held by `handle_ping` (reading resumes with it), and the connection is ready
        if self.writable is PAUSED:
            self.writable = WRITABLE
        else:
            super().resume_writing()
        pong = self.held_pong
        if pong is not None:
            self.held_pong = None
            if not self.transport.is_closing() and not self.lingering:
                self.transport.write(pong)
                if not self.deferred:  # else reading resumes once the input left for later is handled
                    self.transport.resume_reading()
        if self.connection is not None:
            self.connection.on_resume()

    def handle_ping(self) -> None:
        # uvicorn writes every pong at once, whatever is buffered: a peer that pings and never reads made the
        # gateway hold pongs without bound (issue 24: +169 MiB in 6 s). While our writes are paused only the
        # pong of the latest ping waits, and the peer is not read until it reads.
        pong = b"".join(self.conn.data_to_send())
        if self.lingering or self.transport.is_closing():
            return
        if self.writable.is_set():
            self.transport.write(pong)
            return
        if self.held_pong is not None:
            ws_counters.pongs_coalesced += 1
        else:
            self.transport.pause_reading()
        self.held_pong = pong

    def handle_cont(self, event: Any) -> None:
        # a continuation frame: bounded by `websocket.max_fragments` (uvicorn takes any number)
        if self.lingering or self.close_sent:
            return
        limit = self.hub.config.websocket.max_fragments if self.hub is not None else self.max_fragments
        if len(self.frames) >= limit:
            # each frame costs a parse: one-byte fragments cost ~500 ns of CPU per byte (issue 24)
            self.frames = NO_FRAMES  # type: ignore[assignment]
            ws_counters.fragment_closes += 1
            self.conn.fail(close_codes.POLICY_VIOLATION,
                           f"more than {limit} fragments in one message (websocket.max_fragments)")
            self.handle_parser_exception()
            return
        super().handle_cont(event)

    # -- keepalive: uvicorn's pings and pong deadlines, on the server's wheel (one loop timer for all) -----

    def schedule_ping(self) -> None:
        assert self.ping_interval is not None
        self.keepalive.schedule(self, max(0.0, self.ping_interval - self.last_ping_rtt), PING)

    def send_keepalive_ping(self) -> None:
        # uvicorn's, the pong's deadline on the wheel; not sent while frames flow and the peer's TCP
        # acknowledges them: its ACKs within the interval prove the peer and the path alive, as a pong would
        # (a ping costs a write and a pong's parse, ~3% of the CPU of 10,000 clients at 5 messages a second).
        # A peer gone silent stops acknowledging: it is pinged at the next deadline.
        if self.close_sent or self.transport.is_closing():
            return
        conn = self.connection
        if conn is not None and conn.frames_sent != self.frames_at_ping:
            self.frames_at_ping = conn.frames_sent
            if self.ping_interval and peer_acked_within(self.transport, self.ping_interval):
                ws_counters.pings_skipped += 1
                self.schedule_ping()
                return
        # a random payload identifies this ping: `handle_pong` ignores stale or unsolicited pongs
        self.pending_ping_payload = struct.pack("!I", random.getrandbits(32))
        self.ping_sent_at = self.loop.time()
        self.conn.send_ping(self.pending_ping_payload)
        self.transport.write(b"".join(self.conn.data_to_send()))
        if self.ping_timeout is not None:
            self.keepalive.schedule(self, self.ping_timeout, PONG)
        else:
            self.schedule_ping()

    def handle_pong(self, event: Frame) -> None:
        # uvicorn's: the pong of the ping in flight ends its deadline, and the next ping is scheduled
        if self.pending_ping_payload is None or bytes(event.data) != self.pending_ping_payload:
            return
        self.last_ping_rtt = self.loop.time() - self.ping_sent_at
        self.pending_ping_payload = None
        if self.keepalive.get(self) == PONG:  # without a ping timeout the next ping is scheduled already
            self.schedule_ping()

    def stop_keepalive(self) -> None:
        self.keepalive.cancel(self)
        self.pending_ping_payload = None

    def keepalive_timeout(self) -> None:
        # uvicorn's closes the transport, which waits for the buffer to drain: a peer that never reads was
        # never closed. Close frame, then linger and cut (`linger_close`).
        self.pending_ping_payload = None
        if self.close_sent or self.lingering or self.transport.is_closing():
            return
        self.conn.fail(close_codes.INTERNAL_ERROR, "keepalive ping timeout")
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.linger_close(KICK_GRACE_S)
        self._unregister("closed")

    def linger_close(self, grace: float) -> None:
        """Close after our close frame without a reset: closing a socket with unread input makes the kernel
        send RST, which can destroy the close frame (and its code) before the peer reads it. So: shut our
        side once the buffer (close frame included) is written, drop what the peer still sends, close when
        it closes, and cut it after `grace` seconds if it never does (or never reads)."""
        self.lingering = True
        transport = self.transport
        if transport.is_closing():
            return
        if not transport.can_write_eof():  # TLS: its close_notify already ends the stream cleanly
            transport.close()
            return
        transport.write_eof()
        self.loop.call_later(grace, transport.abort)

    def data_received(self, data: bytes) -> None:
        # uvicorn's parses and handles all of a read at once: once the handshake is done, a read is parsed and
        # handled in turns (`_handle_input`); while lingering it is dropped; before, uvicorn's parses the request
        if self.lingering:
            # dropped; past `LINGER_READ` the peer is not read any more (it is cut at the grace): a kicked peer
            # that floods made the gateway read and drop ~2 GB/s for the grace
            self.dropped += len(data)
            if self.dropped > LINGER_READ and not self.transport.is_closing():
                self.transport.pause_reading()
            return
        if self.handshake_complete:
            unparsed = self.unparsed
            if unparsed is not None:  # read while the rest of the last read waits (reading is paused then)
                data = bytes(unparsed) + data
            self.unparsed = memoryview(data)
            if not self.deferred:
                self._handle_input()
            return
        super().data_received(data)  # the handshake request (events: `handle_events`)
        if not self.handshake_initiated and self.conn.handshake_exc is not None:
            self._refused_by_websockets()

    def handle_events(self) -> None:
        # uvicorn's handles every event of a read at once: the frames that came with the handshake request
        # wait for their turn like the others (`_handle_input`)
        events = self.conn.events_received()
        if not events:
            return
        if self.unhandled is None:
            self.unhandled = deque(events)
        else:
            self.unhandled.extend(events)
        if not self.deferred:
            self._handle_input()

    def _handle_input(self) -> None:
        """Handle what the peer sent, at least one step and at most about `TURN_BUDGET_S` of this turn of the
        loop (less when the connections together spent `TURN_BUDGET_ALL_S`): the parsed events first, then
        the read in slices of `PARSE_SLICE` (once a frame ends the connection, lingering, the rest is neither
        parsed nor handled). What is left waits for the next turn, the peer not read meanwhile (TCP
        back-pressure), so one connection's burst of commands is handled between the other clients' work,
        not ahead of it."""
        paused, self.deferred = self.deferred, False
        now = time.perf_counter()
        deadline = now + TURN_BUDGET_S
        if self.turn is not None:
            deadline = min(deadline, self.turn.until(now))
        conn = self.conn
        while not self.lingering and not self.transport.is_closing():
            unhandled = self.unhandled
            if unhandled:
                self._dispatch(unhandled.popleft())
            elif self.unparsed is not None:
                view = self.unparsed
                self.unparsed = view[PARSE_SLICE:] if len(view) > PARSE_SLICE else None
                if conn.parser is None:  # parked between frames (`_park_parser`): a fresh one
                    conn.parser = Protocol.parse(conn)
                    next(conn.parser)
                conn.receive_data(view[:PARSE_SLICE])  # type: ignore[arg-type]  # a buffer does
                if conn.parser_exc is not None:  # a protocol error: its close frame is queued
                    self.unhandled = self.unparsed = None
                    self.handle_parser_exception()
                    break
                events = conn.events_received()
                if events:
                    self.unhandled = deque(events)
            else:
                self.unhandled = None
                self._park_parser()
                if paused and not self.read_paused and self.held_pong is None:  # not paused for another reason
                    self.transport.resume_reading()                            # (uvicorn's, a held pong)
                return
            if time.perf_counter() >= deadline and (self.unhandled or self.unparsed is not None):
                ws_counters.input_deferrals += 1
                self.transport.pause_reading()
                self.deferred = True
                self.loop.call_soon(self._handle_input)
                return
        self.unhandled = self.unparsed = None  # closing: nothing more is handled
        if paused and self.lingering and not self.transport.is_closing():
            # read (and drop, up to LINGER_READ) what the peer still sends: its end of the stream closes the
            # connection cleanly, where a cut at the grace could reset it
            self.transport.resume_reading()

    def _park_parser(self) -> None:
        """Between two frames, nothing of the next one read, websockets' frame parser is dropped: two suspended
        generators and the last frame parsed (a local of the outer one), ~0.6 KiB an idle connection would
        hold for nothing; the next read starts a fresh one (`_handle_input`). Mid-frame, it stays."""
        conn = self.conn
        parser = conn.parser
        if parser is None or not self.handshake_complete or conn.reader.buffer or conn.parser_exc is not None:
            return
        inner: Any = parser  # a generator
        while inner.gi_yieldfrom is not None:
            inner = inner.gi_yieldfrom
        if inner.gi_code is _AT_EOF:  # websockets' parser waits for the first byte of the next frame
            conn.parser = None  # type: ignore[assignment]

    def _dispatch(self, event: Event) -> None:
        """One event, as uvicorn's `handle_events` does it."""
        if isinstance(event, Request):
            self.handle_connect(event)
            return
        if not isinstance(event, Frame):  # a Response: a server is never sent one
            return
        opcode = event.opcode
        if opcode is Opcode.TEXT:
            self.handle_text(event)
        elif opcode is Opcode.CONT:
            self.handle_cont(event)
        elif opcode is Opcode.BINARY:
            self.handle_bytes(event)
        elif opcode is Opcode.PING:
            self.handle_ping()
        elif opcode is Opcode.PONG:
            self.handle_pong(event)
        elif opcode is Opcode.CLOSE:
            self.handle_close(event)

    def _refused_by_websockets(self) -> None:
        """websockets refused the handshake request itself (a line over 8 KiB, over 128 headers, not HTTP):
        it queued its answer (414, 431; nothing for a non-HTTP request) but emits no event, so uvicorn would
        neither write it nor close, and the connection would hold its slot for good. Answer and close."""
        self.handshake_initiated = self.handshake_complete = self.close_sent = True
        if self.limiter is not None:
            self.limiter.refuse("header_too_large", self.client[0] if self.client else "")
        self.transport.write(b"".join(self.conn.data_to_send()))
        # websockets' parser (a generator holding the request's bytes) and the traceback of its refusal refer
        # back to its protocol: cycles that only a full collection would free (gateway/gcpolicy.py), i.e.
        # ~20 KiB per refusal for up to a minute under a flood of them; nothing is parsed any more
        self.conn.parser = None  # type: ignore[assignment]
        if self.conn.handshake_exc is not None:
            self.conn.handshake_exc.__traceback__ = None  # its frames are the parser's
        self.linger_close(KICK_GRACE_S)

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn's (an ASGI endpoint gets its disconnect), the HTTP port's slot, and a served client is gone
        super().connection_lost(exc)
        if self.limiter is not None:
            self.limiter.release(self.transport)
        if self.connection is not None:
            self.connection.on_lost()
            self._unregister("closed")

    # -- serving /ws without ASGI ------------------------------------------------------------------------

    def handle_connect(self, event: Request) -> None:
        # The handshake request. `/ws` is answered here; anything else goes to uvicorn's, which runs the ASGI
        # app: other paths (404), `/ws` when disabled (`TransportOff`: 403) or with `direct_write` off.
        hub = self.hub
        path, _, query = event.path.partition("?")
        if hub is None or path != WS_PATH or not hub.config.websocket.enabled or not hub.config.websocket.direct_write:
            # the ASGI app's: uvicorn's receive queue, and an event its `send` awaits
            self.queue = asyncio.Queue()
            writable = self.writable
            self.writable = asyncio.Event()
            if writable.is_set():
                self.writable.set()
            super().handle_connect(event)
            return
        self.served = True  # uvicorn's handlers put events in `queue` (DISCARD); nobody reads them
        self.server = None  # the local address, for an ASGI scope only
        self.handshake_initiated = True
        origin = event.headers.get("Origin")
        if origin is not None and self.origins is not None and not self.origins.allows(origin, event.headers.get("Host")):
            self.bad_input("ws", "origin %r refused (server.allowed_origins)", origin[:100])
            self._answer_and_close(self.conn.reject(403, "origin not allowed (server.allowed_origins)\n"))
            return
        response = self.conn.accept(event)
        if response.status_code != 101:  # not a valid upgrade: websockets says why
            self._answer_and_close(response)
            return
        try:
            admission = open_ws_client(hub, query, self.client)
        except RequestError as exc:
            self._upgrade(response)
            assert exc.close_code is not None  # every refusal of the handshake ends a WebSocket with a code
            self.close_with(exc.close_code, close_reason(exc))
            return
        if admission.awaits_hook:
            # the 101 waits for the backend's connect hook; the peer is not read meanwhile
            self.transport.pause_reading()
            admission.hooks.spawn(self._connect_via_backend(hub, admission, event, response))
            return
        self._admit(hub, admission, response)

    def _upgrade(self, response: Response) -> None:
        """Write the 101 answer: the connection is a WebSocket from here on."""
        conn = self.conn
        conn.send_response(response)
        self.transport.write(b"".join(conn.data_to_send()))
        conn.id = None  # type: ignore[assignment]  # a UUID for websockets' users' logs; ours name the peer
        if not conn.extensions:  # none negotiated: read only (frames are parsed and sent through them), shared
            conn.extensions = NO_EXTENSIONS  # type: ignore[assignment]
        self.handshake_complete = True
        # websockets' request parser goes on parsing frames with the handshake request still a local of its
        # generator (~2 KiB for the connection's life): with nothing read past the request it is dropped, and
        # the first frame starts a frame parser
        self._park_parser()
        self.start_keepalive()

    async def _connect_via_backend(self, hub: Hub, admission: Admission, event: Request, response: Response) -> None:
        """The connect hook (gateway/hooks.py), then the 101 and the registration; a refusal is the 101 and
        at once a close with 4003 (the backend's message as the reason), no answer 1013 "backend unavailable"."""
        refusal: RequestError | None = None
        try:
            await admission.pass_backend(event.headers.get_all)
        except RequestError as exc:
            refusal = exc
        if self.transport.is_closing() or self.lingering:
            admission.release()
            return  # the peer left while the backend was asked
        self.transport.resume_reading()
        if refusal is not None:
            self._upgrade(response)
            assert refusal.close_code is not None
            self.close_with(refusal.close_code, close_reason(refusal))
            return
        self._admit(hub, admission, response)

    def _admit(self, hub: Hub, admission: Admission, response: Response) -> None:
        """The 101, then the registration; or, when a revocation, a user's disconnect or the drain came first
        (gateway/pending_connects.py), the close they give a registered client."""
        late = admission.settle()
        self._upgrade(response)
        if late is not None:
            self.close_with(late.code, late.reason)
            return
        hub.clients.register(WSConnection(hub, admission.identity, None, self), ready=True)

    def _answer_and_close(self, response: Response) -> None:
        self.handshake_complete = self.close_sent = True
        self.conn.send_response(response)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()

    def close_with(self, code: int, reason: str) -> None:
        """Send a close frame and linger (see `linger_close`); the connection is not registered, or no more."""
        if self.transport.is_closing() or self.lingering:
            return
        try:
            self.conn.send_close(code, reason)
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
        except Exception:  # already closing on the websockets side
            pass
        self.linger_close(KICK_GRACE_S)

    def _unregister(self, reason: str) -> None:
        conn = self.connection
        if self.served and conn is not None and self.hub is not None:
            conn.closed = True
            self.hub.clients.unregister(conn.identity.client_id, reason)

    def handle_close(self, event: Any) -> None:
        # the peer's close frame: uvicorn's echo and close, and a served client is gone
        super().handle_close(event)
        self._unregister("closed")

    def send_receive_event_to_app(self) -> None:
        # uvicorn decodes a text message itself and logs every invalid one with a traceback (one ERROR per
        # frame a peer chooses to send): check it first and fail the connection with 1007 (RFC 6455 §8.1)
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError as exc:
                self.frames = NO_FRAMES  # type: ignore[assignment]
                self.conn.fail(close_codes.INVALID_DATA, f"invalid UTF-8 in a text message at byte {exc.start}")
                self.handle_parser_exception()
                return
        if not self.served:
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = NO_FRAMES  # type: ignore[assignment]
        conn = self.connection
        if self.close_sent or conn is None or conn.closed or self.hub is None:
            return
        run_frame(self.hub, conn.identity.client_id, data)

    def handle_parser_exception(self) -> None:
        # a peer's protocol error (bad framing 1002, too large 1009, invalid UTF-8 1007): the close frame is
        # queued, the endpoint gets a disconnect; count it and log at a bounded rate, without a traceback
        close = self.conn.close_sent
        assert close is not None
        peer = "%s:%d" % self.client if self.client else "?"
        self.bad_input("ws", "%s: %s, closing with %d", peer, close.reason or "protocol error", close.code)
        # uvicorn's own handler, but lingering instead of closing at once (see linger_close)
        self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.linger_close(KICK_GRACE_S)
        self._unregister("closed")


def protocol_class(
    write_high_water: int,
    socket_send_buffer: int = 0,
    notsent_lowat: int = 0,
    limiter: ConnectionLimiter | None = None,
    bad_input: BadInputLog = FALLBACK_BAD_INPUT,
    hub: Hub | None = None,
    origins: OriginPolicy | None = None,
) -> type[FanoutWSProtocol]:
    """The protocol class uvicorn instantiates per upgraded connection; with a `hub` it serves `/ws` itself."""
    attrs = {"write_high_water": write_high_water, "socket_send_buffer": socket_send_buffer,
             "notsent_lowat": notsent_lowat, "limiter": limiter,
             "bad_input": bad_input, "hub": hub, "origins": origins, "turn": InputTurn()}
    return type("ConfiguredFanoutWSProtocol", (FanoutWSProtocol,), attrs)


class WSConnection(StagedWriter):
    __slots__ = ("websocket", "proto", "frames_sent", "bytes_sent", "entries_sent", "closed", "_outbox", "_writer",
                 "fd", "transport")

    def __init__(self, hub: Hub, identity: ClientIdentity, websocket: WebSocket | None,
                 proto: FanoutWSProtocol | None) -> None:
        super().__init__(hub, identity)
        self.websocket = websocket
        self.proto = proto
        self.frames_sent = 0
        self.bytes_sent = 0
        #: entries (messages, notices, replies) handed to this connection: the stats stream's delivery rate
        self.entries_sent = 0
        self.closed = False
        self._outbox: asyncio.Queue[bytes] | None = None
        self._writer: asyncio.Task[None] | None = None
        #: the socket `direct_fd` hands out (plain TCP, direct write path), -1 once closed
        self.fd = -1
        #: the protocol's transport (direct write path), read once per direct write
        self.transport: asyncio.Transport | None = None
        if proto is not None:
            proto.connection = self
            self.fd = proto.raw_fd
            self.transport = proto.transport
        else:
            self._outbox = asyncio.Queue(maxsize=1)
            self._writer = asyncio.get_running_loop().create_task(self._write_via_asgi())

    # -- fan-out writes ----------------------------------------------------------------------------------

    def deliver(self, batch: Batch, frame: bytes) -> bool:
        if self.closed:
            return False
        self.frames_sent += 1
        self.bytes_sent += len(frame)
        self.entries_sent += len(batch.entries)
        proto = self.proto
        if proto is None:  # the ASGI path: its writer task writes the frame
            assert self._outbox is not None
            self._outbox.put_nowait(frame)
            self._blocked()
            return False
        if proto.transport.is_closing() or proto.lingering:  # closed, or our side already shut
            return False
        cache = framed
        if frame is not cache.payload:
            cache.update(frame)
        data = cache.frame
        return self.write_batch((data,), len(data), batch.more)

    def direct_fd(self, batch: Batch, frame: bytes) -> int:
        # Caught up, nothing staged or buffered before it, writable: the frame may go straight to the
        # socket (gateway/fanwrite.py); counted as delivered here, like `deliver` does.
        fd = self.fd
        if fd < 0 or batch.more or self._staged or self.paused:
            return -1
        transport = self.transport
        assert transport is not None and self.proto is not None  # `fd` is -1 on the ASGI path
        if self.proto.lingering or transport.is_closing() or transport.get_write_buffer_size():
            return -1
        self.frames_sent += 1
        self.bytes_sent += len(frame)
        self.entries_sent += len(batch.entries)
        return fd

    def wire(self, frame: bytes) -> bytes:
        cache = framed
        if frame is not cache.payload:
            cache.update(frame)
        return cache.frame

    def write_rest(self, data: bytes, sent: int) -> bool:
        # a send error (sent < 0) is met again by the transport's own write, which then closes as usual
        return self._write_parts((data[sent:] if sent > 0 else data,))

    def _stream(self) -> asyncio.Transport | None:
        proto = self.proto
        assert proto is not None  # only the direct write path stages
        if proto.transport.is_closing() or proto.lingering:
            return None
        return proto.transport

    def _unblocked(self) -> None:
        if self.blocked_since is not None:
            self.blocked_since = None
            self.hub.scheduler.write_drained(self.identity.client_id)

    def on_pause(self) -> None:
        self.paused = True
        if self.blocked_since is None:  # paused by what the protocol writes itself (pongs): watched as well
            self._blocked()

    def on_resume(self) -> None:
        self.paused = False
        self._unblocked()

    def on_lost(self) -> None:
        self.closed = True
        self.fd = -1
        self.hub.scheduler.write_unwatched(self.identity.client_id)

    async def _write_via_asgi(self) -> None:
        assert self._outbox is not None
        while True:
            frame = await self._outbox.get()
            try:
                assert self.websocket is not None
                await self.websocket.send_text(frame.decode())
            except Exception:
                self.closed = True
                return
            self._unblocked()

    # -- control -------------------------------------------------------------------------------------------

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        if self.closed:
            return
        if self.proto is not None:
            self.flush()  # the round's staged frames go before the close frame
        self.closed = True  # the hub unregisters it, which also forgets it as blocked
        self.fd = -1
        if self._writer is not None:
            self._writer.cancel()
        proto = self.proto
        if proto is None:
            asyncio.get_running_loop().create_task(self._close_via_asgi(code, reason))
            return
        # The close frame waits behind whatever is buffered: a reader that wakes up gets it with the code
        # and reason; one that never reads again is cut after the grace (its buffer will not drain).
        proto.close_with(code, reason)

    async def _close_via_asgi(self, code: int, reason: str) -> None:
        assert self.websocket is not None
        try:
            await self.websocket.close(code, reason)
        except Exception:
            pass

    def describe(self) -> dict[str, Any]:
        return {
            "transport": "ws",
            "peer": self.identity.peer,
            "frames_sent": self.frames_sent,
            "bytes_sent": self.bytes_sent,
            "entries_sent": self.entries_sent,
            "write_blocked": self.blocked_since is not None,
        }


# -- what both ways of serving /ws share ---------------------------------------------------------------------

def open_ws_client(hub: Hub, query: str, peer: tuple[str, int] | None) -> Admission:
    """The handshake of a `/ws` connection (its query string, `?token=`, `?id=`): gateway/transports/handshake.py.
    Raises its `RequestError`, whose `close_code` and `close_reason` are the close frame the peer gets."""
    params = parse_qs(query, keep_blank_values=True)
    tokens, ids = params.get("token"), params.get("id")
    return admit(hub, "ws", peer, token=tokens[-1] if tokens else None, requested_id=ids[-1] if ids else None)


def run_frame(hub: Hub, client_id: str, data: bytes | str) -> None:
    """One command message of a registered client. A failure is our bug, not the peer's: this client is closed
    with 1011, nobody else is disturbed."""
    try:
        handle_payload(hub, client_id, data)
    except Exception:
        log.exception("websocket %s failed", client_id)
        hub.clients.kick(client_id, close_codes.INTERNAL_ERROR, "internal error", "error")


async def websocket_endpoint(websocket: WebSocket) -> None:
    """`/ws` through ASGI, with `websocket.direct_write = false` only (the protocol serves it otherwise,
    `FanoutWSProtocol.handle_connect`): the same handshake, commands and connection object, but commands come
    by ASGI `receive` and batches go by `send` from the connection's writer task (docs/benchmarks-history.md
    compares the two write paths). The Origin check is the app's middleware (gateway/origin.py), same answer."""
    hub: Hub = websocket.app.state.hub
    await websocket.accept()
    try:
        admission = open_ws_client(hub, websocket.scope["query_string"].decode("latin-1"), websocket.client)
        await admission.pass_backend(websocket.headers.getlist)
    except RequestError as exc:  # the handshake's refusals; the backend's: 4003 refused, 1013 backend unavailable
        assert exc.close_code is not None
        await websocket.close(exc.close_code, close_reason(exc))
        return
    late = admission.settle()
    if late is not None:  # revoked, disconnected or draining while the connect hook was awaited
        await websocket.close(late.code, late.reason)
        return
    identity = admission.identity
    client_id = identity.client_id
    conn = WSConnection(hub, identity, websocket, None)
    hub.clients.register(conn, ready=True)
    reason = "closed"
    try:
        while True:  # also after a kick: until its close is sent (the disconnect comes then)
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            payload = message.get("text")
            run_frame(hub, client_id, payload if payload is not None else message.get("bytes") or b"")
    except Exception:  # the ASGI server's failure, not a command's (run_frame)
        log.exception("websocket %s failed", client_id)
        reason = "error"
    finally:
        conn.closed = True
        hub.clients.unregister(client_id, reason)
