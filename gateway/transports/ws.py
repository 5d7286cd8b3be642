"""WebSocket transport: our own asyncio protocol for `/ws`, holding websockets' sans-I/O protocol.

uvicorn's HTTP protocol (gateway/edge/netguard.py) parses an upgrade request and hands the connection over: it
makes an instance of the class `protocol_class` returned (with its `config`, `server_state` and `app_state`,
which this protocol does not need), calls `connection_made` and `data_received` with the request's bytes, and
makes it the transport's protocol. From there the connection is this module's, as websockets' own asyncio
server does it: bytes in go to websockets (`receive_data`, then `events_received`), bytes out come from it
(`data_to_send`). The handshake is answered by ws_handshake.py (path, Origin, `?token=`, `?id=`, the connect
hook, the 101), each command message goes to gateway/commands.py as it is parsed, and the scheduler writes each batch
as one pre-built text frame straight to the transport (`WSConnection`), never awaiting: a client whose writes
are paused is not ready until asyncio calls `resume_writing`. A connection to `centrifugo.path` speaks
Centrifugo's client protocol instead (gateway/transports/ws_centrifugo.py): its messages go to its link.

The connection's life is one state value (ws_state.py: handshake, awaiting the connect hook, open, closing,
closed), changed only by `move`; asyncio's `pause_writing` and `resume_writing` set the one write-pause flag,
`paused`, which the scheduler's side (`WSConnection`, gateway/transports/staging.py) reads.

Between two messages, nothing of the next one read, a connection holds no websockets object: the frame
parser it used goes back to a small pool of the server's and the next read takes one (`_park`). The frame
headers of what is fed are read alongside (RFC 6455 framing, wsframes.py `frames_fed`), so the boundary is
known without looking into websockets' parser; a parser at a boundary, its state OPEN and no message begun,
is as good as a new one (an inflating one too: deflate is negotiated without context takeover). Pings and
close frames this side starts are serialized here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, cast

from websockets.frames import Close, Frame, Opcode
from websockets.protocol import OPEN, Event, Protocol

from core import Batch, Sink

from .. import close_codes
from ..centrifugo.client_codes import close_code as centrifugo_close_code
from ..centrifugo.client_codes import close_reason as centrifugo_close_reason
from ..edge.netguard import ConnectionLimiter
from ..edge.origin import OriginPolicy
from ..edge.ratelog import BadInputLog
from ..fanwrite import raw_fd
from ..scheduler import Delivered
from ..session import ClientSession, LateRefused
from ..session_services import SessionServices
from ..wsframes import frames_fed
from .handshake import close_reason
from .staging import BLOCKED, StagedWriter
from .streams import KICK_GRACE_S, tune_stream
from .ws_counters import WSCounters, ws_counters
from .ws_deflate import DeflateFramer, PlainFramer
from .ws_handshake import Handshake
from .ws_service import CentrifugoEndpoint, CentrifugoLink, WSService
from .ws_state import WS_CLOSING, WS_OPEN, WSState, checked_move
from .ws_turns import PARSE_SLICE, TURN_BUDGET_S

__all__ = ["WSConnection", "WSCounters", "WebSocketProtocol", "protocol_class", "ws_counters"]

#: bytes a closing connection is read for (and dropped) before it is not read any more
LINGER_READ = 16384


def _control_frame(opcode: Opcode, data: bytes) -> bytes:
    return Frame(opcode, data).serialize(mask=False)


class WebSocketProtocol(asyncio.Protocol):
    """One `/ws` connection from its upgrade request to its loss (module docstring)."""

    __slots__ = (
        "transport",
        "peer",
        "state",
        "handshake",
        "ws",
        "connection",
        "dropped",
        "unparsed",
        "unhandled",
        "deferred",
        "raw_fd",
        "held_pong",
        "paused",
        "frame_left",
        "frame_head",
        "message",
        "message_text",
        "ping_payload",
        "ping_sent_at",
        "ping_rtt",
        "frames_at_ping",
        "in_message",
        "window_bits",
        "centrifugo",
    )

    #: set on the class `protocol_class` makes for one server
    service: WSService
    #: set by `connection_made`, which uvicorn calls right after making the protocol
    transport: asyncio.Transport

    def __init__(self, config: object = None, server_state: Any = None, app_state: object = None) -> None:
        service = self.service
        if service.connections is None and server_state is not None:
            service.connections = server_state.connections
        self.peer: tuple[str, int] | None = None
        #: where the connection's life is (ws_state.py); changed by `move` only
        self.state = WSState.HANDSHAKE
        #: the upgrade (ws_handshake.py) until it is answered, then None
        self.handshake: Handshake | None = Handshake(self)
        #: the frame parser while input is handled, else None (`_park`)
        self.ws: Protocol | None = None
        self.connection: WSConnection | None = None
        #: bytes read and dropped while closing
        self.dropped = 0
        #: the part of the last read not fed to the parser yet, and the parsed events not handled yet: what is
        #: left when a turn's budget is spent (at most one read; the peer is not read while they wait)
        self.unparsed: memoryview | None = None
        self.unhandled: deque[Event] | None = None
        #: `_handle_input` is scheduled for the next turn (reading is paused until it is done)
        self.deferred = False
        #: the socket's descriptor when the fan-out writer may write it directly (plain TCP), else -1
        self.raw_fd = -1
        #: the pong answering the peer's latest ping, held while our writes are paused (at most one waits,
        #: RFC 6455 §5.5.3); reading is paused with it, so a peer that pings and never reads is not read either
        self.held_pong: bytes | None = None
        #: the transport is above its high-water mark (`pause_writing` until `resume_writing`): the one flag,
        #: which the scheduler's side reads (`WSConnection`, gateway/transports/staging.py)
        self.paused = False
        #: where the client's frames stand (wsframes.py `frames_fed`: bytes of the current frame still to come,
        #: a header read in part; 0 and b"" at a frame boundary), and whether the frames left a fragmented
        #: message unfinished (`_park`)
        self.frame_left = 0
        self.frame_head = b""
        self.in_message = False
        #: the frames of a fragmented message so far, and whether it is text
        self.message: list[bytes] | None = None
        self.message_text = False
        self.ping_payload: bytes | None = None
        self.ping_sent_at = self.ping_rtt = 0.0
        self.frames_at_ping = 0
        #: permessage-deflate's window for our frames, 0 when not negotiated (its parsers then inflate)
        self.window_bits = 0
        #: a connection of Centrifugo's client protocol: its messages go there (gateway/transports/ws_centrifugo.py)
        self.centrifugo: CentrifugoLink | None = None

    # -- asyncio's calls ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # a stream (uvloop's is no subclass)
        peer = transport.get_extra_info("peername")
        self.peer = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        config = self.service.config
        tune_stream(transport, config.write_high_water, config.socket_send_buffer, config.notsent_lowat_bytes)
        self.raw_fd = raw_fd(transport)
        if self.service.connections is not None:
            self.service.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.state is not WS_OPEN:
            if self.state is WS_CLOSING:
                # dropped; past LINGER_READ the peer is not read any more (it is cut at the grace): a kicked
                # peer that floods made the gateway read and drop ~2 GB/s for the grace
                self.dropped += len(data)
                if self.dropped > LINGER_READ and not self.transport.is_closing():
                    self.transport.pause_reading()
            elif self.handshake is not None:
                self.handshake.received(data)
            return
        unparsed = self.unparsed
        if unparsed is not None:  # read while the rest of the last read waits (reading is paused then)
            data = bytes(unparsed) + data
        self.unparsed = memoryview(data)
        if not self.deferred:
            self._handle_input()

    def pause_writing(self) -> None:
        self.paused = True
        if self.connection is not None:
            self.connection.on_pause()

    def resume_writing(self) -> None:
        self.paused = False
        pong = self.held_pong
        if pong is not None:
            self.held_pong = None
            if self.state is WS_OPEN and not self.transport.is_closing():
                self.transport.write(pong)
                if not self.deferred:  # else reading resumes once the input left for later is handled
                    self.transport.resume_reading()
        if self.connection is not None:
            self.connection.on_resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.move(WSState.CLOSED)
        self.handshake = None
        service = self.service
        service.limiter.release(self.transport)
        if service.connections is not None:
            service.connections.discard(self)
        service.keepalive.stop(self)
        self.ws = None
        self.unhandled = self.unparsed = None
        if self.centrifugo is not None:
            self.centrifugo.lost()
        if self.connection is not None:
            self.connection.on_lost()
            self._unregister("closed")

    def shutdown(self) -> None:
        """uvicorn's server shutting down: the clients were closed already (`Hub.close_all_clients`); one
        still in its handshake is closed now."""
        state = self.state
        if state is WS_OPEN:
            self.close_with(close_codes.GOING_AWAY, "server shutting down")
        elif state in (WSState.HANDSHAKE, WSState.AWAITING_HOOK) and not self.transport.is_closing():
            self.move(WSState.CLOSING)
            self.transport.close()

    def move(self, new: WSState) -> None:
        """The one place the state changes (ws_state.py `MOVES`; another move is our bug: `IllegalMove`).
        From CLOSING on no frame goes, not even a crowd's: the sink is shut with it."""
        self.state = checked_move(self.state, new)
        if new is WS_CLOSING and self.connection is not None:
            self.connection.sink.open = False

    # -- the handshake's end (ws_handshake.py) ---------------------------------------------------------------

    def open_session(self, session: ClientSession) -> None:
        """The 101 is written: keepalive, then the registration; or, when a revocation, a user's disconnect or
        the drain came first (gateway/pending_connects.py), the close they give a registered client."""
        self.service.keepalive.start(self)
        connection = WSConnection(session, self)
        try:
            session.open(connection)
        except LateRefused as late:
            self.connection = None
            assert late.close_code is not None
            self.close_with(late.close_code, close_reason(late))

    # -- input --------------------------------------------------------------------------------------------

    def _handle_input(self) -> None:
        """Handle what the peer sent, at least one step and at most about `TURN_BUDGET_S` of this turn of the
        loop (less when the connections together spent theirs, `InputTurn`): the parsed events first, then
        the read in slices of `PARSE_SLICE` (once a frame ends the connection, the rest is neither parsed nor
        handled). What is left waits for the next turn, the peer not read meanwhile (TCP back-pressure), so
        one connection's burst of commands is handled between the other clients' work, not ahead of it."""
        paused, self.deferred = self.deferred, False
        now = time.perf_counter()
        deadline = min(now + TURN_BUDGET_S, self.service.turn.until(now))
        transport = self.transport
        link = self.centrifugo
        while self.state is WS_OPEN and not transport.is_closing():
            unhandled = self.unhandled
            if link is not None and link.busy:  # a frame's Centrifugo commands first, one a step
                if link.waiting:  # the connect hook is asked: reading is paused until `resume_input`
                    self.deferred = True
                    return
                link.step()
            elif unhandled:
                self._dispatch(unhandled.popleft())
            elif self.unparsed is not None:
                self._parse_slice()
            else:
                self.unhandled = None
                self._park()
                if paused and self.held_pong is None:  # not paused for a held pong
                    transport.resume_reading()
                return
            if time.perf_counter() >= deadline and (
                self.unhandled or self.unparsed is not None or (link is not None and link.busy)
            ):
                ws_counters.input_deferrals += 1
                transport.pause_reading()
                self.deferred = True
                asyncio.get_running_loop().call_soon(self._handle_input)
                return
        self.unhandled = self.unparsed = None  # closing: nothing more is handled
        if paused and self.state is WS_CLOSING and not transport.is_closing():
            # read (and drop, up to LINGER_READ) what the peer still sends: its end of the stream closes the
            # connection cleanly, where a cut at the grace could reset it
            transport.resume_reading()

    def resume_input(self) -> None:
        """A Centrifugo connect hook answered: its connection's commands and input go on in the next turn."""
        if not self.deferred:
            self.deferred = True
            self.transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._handle_input)

    def _parse_slice(self) -> None:
        view = self.unparsed
        assert view is not None
        self.unparsed = view[PARSE_SLICE:] if len(view) > PARSE_SLICE else None
        parser = self.ws
        if parser is None:
            parser = self.ws = self.service.parsers.take(self.window_bits > 0)
        chunk = bytes(view[:PARSE_SLICE])
        parser.receive_data(chunk)
        self.frame_left, self.frame_head = frames_fed(self.frame_left, self.frame_head, chunk)
        if parser.parser_exc is not None:  # a protocol error: its close frame is queued
            self.unhandled = self.unparsed = None
            self._failed(parser)
            return
        events = parser.events_received()
        if not events:
            return
        self.unhandled = deque(events)
        answered = False  # a ping's pong (queued by the parser) or a close's echo waits in it
        for event in events:
            if not isinstance(event, Frame):
                continue
            opcode = event.opcode
            if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
                self.in_message = not event.fin
            elif opcode is Opcode.CONT:
                self.in_message = not event.fin
            elif opcode is Opcode.PING or opcode is Opcode.CLOSE:
                answered = True
        if not answered:
            self._park()  # the events are out: a connection whose turn is over holds no parser meanwhile

    def _park(self) -> None:
        """Give the frame parser back to the pool when it is at a frame boundary with no message begun: an
        idle connection then holds no websockets object (the parser, its reader and its two suspended
        generators: ~1.5 KiB it would hold for nothing)."""
        parser = self.ws
        if parser is None or self.frame_left or self.frame_head or self.in_message or parser.state is not OPEN:
            return
        self.ws = None
        self.service.parsers.give_back(parser, self.window_bits > 0)

    def _dispatch(self, event: Event) -> None:
        if not isinstance(event, Frame):
            return
        data = bytes(event.data)  # the same object when it is bytes already
        opcode = event.opcode
        if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
            if event.fin:
                self._message(data, opcode is Opcode.TEXT)
            else:
                self.message = [data]
                self.message_text = opcode is Opcode.TEXT
        elif opcode is Opcode.CONT:
            self._continuation(data, event.fin)
        elif opcode is Opcode.PING:
            self._answer_ping()
        elif opcode is Opcode.PONG:
            self.service.keepalive.pong(self, data)
        elif opcode is Opcode.CLOSE:
            self._peer_closed()

    def _continuation(self, data: bytes, fin: bool) -> None:
        """A continuation frame: at most `websocket.max_fragments` frames per message (each costs a parse:
        one-byte fragments cost ~500 ns of CPU per byte)."""
        message = self.message
        assert message is not None  # websockets refuses a continuation frame with no message begun
        limit = self.service.config.max_fragments
        if len(message) >= limit:
            self.message = None
            ws_counters.fragment_closes += 1
            self._failed(
                self.ws, close_codes.POLICY_VIOLATION, f"more than {limit} fragments in one message (websocket.max_fragments)"
            )
            return
        message.append(data)
        if fin:
            self.message = None
            self._message(b"".join(message), self.message_text)

    def _message(self, data: bytes, text: bool) -> None:
        """A whole message: a text one must be UTF-8 (else 1007, RFC 6455 §8.1), then its commands run."""
        if text:
            try:
                data.decode()
            except UnicodeDecodeError as exc:
                self._failed(self.ws, close_codes.INVALID_DATA, f"invalid UTF-8 in a text message at byte {exc.start}")
                return
        if self.centrifugo is not None:
            self.centrifugo.received(data, text)
            return
        conn = self.connection
        if conn is not None and not conn.closed:
            conn.session.handle(data)

    def _answer_ping(self) -> None:
        """websockets queued the pong. While our writes are paused only the pong of the latest ping waits,
        and the peer is not read until it reads: a peer that pings and never reads made the gateway hold
        pongs without bound (+169 MiB in 6 s)."""
        parser = self.ws
        assert parser is not None
        pongs = parser.data_to_send()  # one per frame: the pongs of every ping of this slice
        if not pongs:  # went (or waits) with the first ping of the slice
            return
        if not self.paused:
            self.transport.write(b"".join(pongs))
            return
        coalesced = len(pongs) - 1
        if self.held_pong is not None:
            coalesced += 1
        else:
            self.transport.pause_reading()
        ws_counters.pongs_coalesced += coalesced
        self.held_pong = pongs[-1]

    def _peer_closed(self) -> None:
        """The peer's close frame: websockets queued the echo; write it and close, the client is gone."""
        parser = self.ws
        assert parser is not None
        self.move(WSState.CLOSING)
        self.transport.write(b"".join(parser.data_to_send()))
        self.transport.close()
        self._unregister("closed")

    def _failed(self, parser: Protocol | None, code: int = 0, reason: str = "") -> None:
        """A peer's protocol error (bad framing 1002, too large 1009, invalid UTF-8 1007: websockets queued the
        close frame; or a bound of ours, `code` and `reason`, closed the same way): count it and log at a
        bounded rate, without a traceback, then linger and forget the client."""
        if parser is None:  # parked already: the events were out of it (a bound of ours, `code`)
            parser = self.ws = self.service.parsers.take(self.window_bits > 0)
        if code:
            parser.fail(code, reason)
        close = parser.close_sent
        assert close is not None
        peer = "%s:%d" % self.peer if self.peer else "?"
        self.service.bad_input("ws", "%s: %s, closing with %d", peer, close.reason or "protocol error", close.code)
        self.transport.write(b"".join(parser.data_to_send()))
        self.linger_close(KICK_GRACE_S)
        self._unregister("closed")

    # -- keepalive (gateway/transports/ws_keepalive.py) ------------------------------------------------

    def can_ping(self) -> bool:
        return self.state is WS_OPEN and not self.transport.is_closing()

    def frames_flowed(self) -> bool:
        conn = self.connection
        if conn is None or conn.sink.frames == self.frames_at_ping:
            return False
        self.frames_at_ping = conn.sink.frames
        return True

    def write_ping(self, payload: bytes) -> None:
        self.transport.write(_control_frame(Opcode.PING, payload))

    def keepalive_timed_out(self) -> None:
        """The pong did not come: close frame, then linger and cut (a peer that never reads never drains
        the buffer a plain close would wait for)."""
        if self.state is not WS_OPEN or self.transport.is_closing():
            return
        self.close_with(close_codes.INTERNAL_ERROR, "keepalive ping timeout")
        self._unregister("closed")

    # -- closing ------------------------------------------------------------------------------------------

    def close_with(self, code: int, reason: str) -> None:
        """Write a close frame and linger (`linger_close`); the connection is not registered, or no more."""
        if self.state is not WS_OPEN or self.transport.is_closing():
            return
        if self.centrifugo is not None:  # never one of our 4xxx codes there (gateway/centrifugo/client_codes.py)
            code, reason = centrifugo_close_code(code), centrifugo_close_reason(reason)
        self.transport.write(_control_frame(Opcode.CLOSE, Close(code, reason).serialize()))
        self.linger_close(KICK_GRACE_S)

    def linger_close(self, grace: float) -> None:
        """Close after our close frame without a reset: closing a socket with unread input makes the kernel
        send RST, which can destroy the close frame (and its code) before the peer reads it. So: shut our
        side once the buffer (close frame included) is written, drop what the peer still sends, close when
        it closes, and cut it after `grace` seconds if it never does (or never reads)."""
        self.move(WSState.CLOSING)
        self.service.keepalive.stop(self)
        transport = self.transport
        if transport.is_closing():
            return
        if not transport.can_write_eof():  # TLS: its close_notify already ends the stream cleanly
            transport.close()
            return
        transport.write_eof()
        asyncio.get_running_loop().call_later(grace, transport.abort)

    def forget(self) -> None:
        """Closed by its Centrifugo session before it registered: nothing more to do with it."""
        self._unregister("closed")

    def _unregister(self, reason: str) -> None:
        conn = self.connection
        if conn is not None:
            conn.closed = True
            conn.session.gone(reason)


def protocol_class(
    services: SessionServices,
    limiter: ConnectionLimiter,
    origins: OriginPolicy,
    bad_input: BadInputLog,
    centrifugo: CentrifugoEndpoint | None = None,
) -> type[WebSocketProtocol]:
    """The class uvicorn instantiates per upgraded connection of one server (its `ws` setting); `centrifugo`:
    Centrifugo's client protocol at its path (gateway/transports/ws_centrifugo.py `centrifugo_endpoint`)."""
    service = WSService(services, limiter, origins, bad_input)
    service.centrifugo = centrifugo
    return type("ServedWebSocketProtocol", (WebSocketProtocol,), {"__slots__": (), "service": service})


class WSConnection(StagedWriter):
    """The scheduler's side of a WebSocket client: its batches as text frames on the protocol's transport."""

    __slots__ = ("proto", "sink", "crowd_sink", "closed", "fd", "transport", "framer", "wire_variant")

    def __init__(self, session: ClientSession, proto: WebSocketProtocol) -> None:
        super().__init__(session, proto)
        self.proto = proto
        #: nothing more is written (kicked, closing, lost)
        self.closed = False
        #: the socket `direct_fd` hands out (plain TCP), -1 once closed
        self.fd = proto.raw_fd
        self.transport = proto.transport
        #: the window bits of our compressed frames, 0: plain (`DirectWritable.wire_variant`), and their framer
        self.wire_variant = proto.window_bits
        self.framer: PlainFramer | DeflateFramer = proto.service.framers.for_window(proto.window_bits)
        #: what was delivered (its counters), and where the engine may gather this client into crowds (a
        #: plain TCP socket only: the fan-out writer writes to its descriptor)
        self.sink = Sink(self.fd, self.wire_variant, self.transport, self)
        self.crowd_sink: Sink | None = self.sink if self.fd >= 0 else None
        proto.connection = self

    @property
    def entries_sent(self) -> int:
        """Entries (messages, notices, replies) delivered, through a crowd or not: the stats stream's rate."""
        return self.sink.entries

    def counted(self, entries: int, size: int) -> None:
        """A frame of `entries` and `size` bytes delivered (a crowd's are counted by the engine)."""
        sink = self.sink
        sink.frames += 1
        sink.bytes += size
        sink.entries += entries

    def _staging(self, staged: bool) -> None:
        self._sink_state()

    def _sink_state(self) -> None:
        """A crowd's frame may go straight to the socket only with nothing staged before it and no close
        begun (the transport's own state is asked at each send: `Sender.submit`)."""
        self.sink.open = not self.closed and self.fd >= 0 and not self._staged and self.proto.state is WS_OPEN

    # -- fan-out writes ----------------------------------------------------------------------------------

    def deliver(self, batch: Batch, frame: bytes) -> Delivered:
        if self.closed:
            return BLOCKED
        self.counted(len(batch.entries), len(frame))
        if self.transport.is_closing() or self.proto.state is not WS_OPEN:  # closed, or our side already shut
            return BLOCKED
        data = self.framer.framed(frame)
        ws_counters.payload_bytes += len(frame)
        ws_counters.wire_bytes += len(data)
        return self.write_batch((data,), len(data), batch.more)

    def direct_fd(self, batch: Batch, frame: bytes) -> int:
        # Caught up, nothing staged or buffered before it, writable: the frame may go straight to the
        # socket (gateway/fanwrite.py); counted as delivered here, like `deliver` does.
        fd = self.fd
        proto = self.proto
        if fd < 0 or self._staged or proto.paused or proto.state is not WS_OPEN:
            return -1
        transport = self.transport
        if transport.get_write_buffer_size() or transport.is_closing():
            return -1
        self.counted(len(batch.entries), len(frame))
        return fd

    def gathered_wire(self, entry: bytes, frame: bytes, sinks: list[Sink]) -> bytes:
        return self.wire(frame, len(sinks))

    def wire(self, frame: bytes, count: int) -> bytes:
        data = self.framer.framed(frame)
        ws_counters.payload_bytes += len(frame) * count
        ws_counters.wire_bytes += len(data) * count
        return data

    def write_rest(self, data: bytes, sent: int) -> bool:
        # a send error (sent < 0) is met again by the transport's own write, which then closes as usual
        return self._write_parts((data[sent:] if sent > 0 else data,))

    def _stream(self) -> asyncio.Transport | None:
        if self.transport.is_closing() or self.proto.state is not WS_OPEN:
            return None
        return self.transport

    def on_pause(self) -> None:
        if self.blocked_since is None:  # paused by what the protocol writes itself (pongs): watched as well
            self._blocked()

    def on_resume(self) -> None:
        self._drained()

    def on_lost(self) -> None:
        self.closed = True
        self.fd = -1
        self.sink.open = False

    # -- control -------------------------------------------------------------------------------------------

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        if self.closed:
            return
        self.flush()  # the round's staged frames go before the close frame
        self.closed = True  # the hub unregisters it, which also forgets it as blocked
        self.fd = -1
        self.sink.open = False
        # The close frame waits behind whatever is buffered: a reader that wakes up gets it with the code
        # and reason; one that never reads again is cut after the grace (its buffer will not drain).
        self.proto.close_with(code, reason)

    def describe(self) -> dict[str, Any]:
        return {
            "transport": "ws",
            "peer": self.identity.peer,
            "frames_sent": self.sink.frames,
            "bytes_sent": self.sink.bytes,
            "entries_sent": self.sink.entries,
            "write_blocked": self.blocked_since is not None,
        }
