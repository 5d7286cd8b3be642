"""Centrifugo's client protocol v2 on our WebSocket protocol (gateway/transports/ws.py), at `centrifugo.path`.

The handshake echoes the subprotocol the SDK asks for (`centrifuge-json`, `centrifuge-protobuf`; Node's `ws`
aborts without it); `?format=protobuf` or `?cf_protocol=protobuf` asks for Protobuf too. The connection then
has no session until its `connect` command (gateway/centrifugo/client_session.py), which this module's
`CentrifugoLink` serves: writes, closes, the connect timeout, and the pings Centrifugo's SDKs expect (a `{}`
every `centrifugo.ping_interval_s` whether data flows or not, answered by a `{}` command within
`centrifugo.pong_timeout_s`, else close 3012), on one timer wheel per server (ws_keepalive.py).

Once connected, `CentrifugoConnection` is the scheduler's side: the same batches as a `/ws` client's, each
converted to the codec's frame once for every Centrifugo client that gets it (gateway/centrifugo/client_frames.py);
its `wire_variant` (negative: one per codec, and per window when deflate was negotiated) keeps its direct writes
and its crowds (the engine's, as on `/ws`: `gathered_wire` converts the crowd's entry once for all of it) apart
from `/ws` frames and from the other forms'.

permessage-deflate is negotiated as on `/ws` (ws_deflate.py, with `websocket.compression`): every frame such a
client gets (replies, pings, pushes, publications) is compressed once per distinct converted frame and window
for all the clients of that codec and window (`Framers.for_frames`), frames below
`websocket.compression_min_bytes` go as they are; its compressed commands are inflated by ws.py's parsers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from websockets.http11 import Request
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from core import Batch, Sink

from ..centrifugo import client_codes as codes
from ..centrifugo.client_codec import Codec, JsonCodec
from ..centrifugo.client_frames import LOST_ID, Answers, CentrifugoFramer, Converted
from ..centrifugo.client_proto import ProtobufCodec
from ..centrifugo.client_session import CentrifugoSession
from ..scheduler import Delivered
from ..session import ClientSession
from ..session_services import SessionServices
from ..wsframes import payload_offset, text_frame_header
from .staging import BLOCKED, DONE
from .ws import WebSocketProtocol, WSConnection
from .ws_counters import ws_counters
from .ws_deflate import FrameDeflater, offer_factory
from .ws_keepalive import Keepalive
from .ws_state import WS_OPEN

#: the subprotocols, in the order preferred when a client offers both
JSON_SUBPROTOCOL = Subprotocol("centrifuge-json")
PROTOBUF_SUBPROTOCOL = Subprotocol("centrifuge-protobuf")


def _select_subprotocol(_: ServerProtocol, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    for name in (PROTOBUF_SUBPROTOCOL, JSON_SUBPROTOCOL):
        if name in offered:
            return name
    return None  # none offered: JSON, with no subprotocol header


def wire_variant(codec_variant: int, window_bits: int) -> int:
    """A connection's `wire_variant`: the codec's (-1, -2) uncompressed, else one per codec and window
    (windows 8 to 15: JSON -24 to -31, Protobuf -40 to -47), never another's nor a `/ws` window's (positive)."""
    return codec_variant * 16 - window_bits if window_bits else codec_variant


class CentrifugoEndpoint:
    """What a server's Centrifugo connections share: the path, the codecs and their framers, the ping wheel."""

    def __init__(self, services: SessionServices) -> None:
        self.services = services
        self.config = services.config.centrifugo
        self.path = self.config.path
        self.codecs: dict[str, Codec] = {"json": JsonCodec(), "protobuf": ProtobufCodec()}
        self.framers = {name: CentrifugoFramer(codec) for name, codec in self.codecs.items()}
        self.keepalive = Keepalive(self.config.ping_interval_s, self.config.pong_timeout_s)
        self.deflate = services.config.websocket.compression == "deflate"

    def handshake(self, max_size: int, logger: Any) -> ServerProtocol:
        """The handshake's protocol: websockets' own, choosing the SDK's subprotocol and accepting
        permessage-deflate as `/ws` does (`websocket.compression`)."""
        extensions = [offer_factory()] if self.deflate else None
        return ServerProtocol(select_subprotocol=_select_subprotocol, extensions=extensions, max_size=max_size, logger=logger)

    def codec_name(self, subprotocol: str | None, query: str) -> str:
        params = parse_qs(query)
        asked = params.get("format", []) + params.get("cf_protocol", [])
        if subprotocol == PROTOBUF_SUBPROTOCOL or "protobuf" in asked:
            return "protobuf"
        return "json"

    def link(self, proto: WebSocketProtocol, request: Request, codec_name: str) -> CentrifugoLink:
        return CentrifugoLink(self, proto, codec_name, request)


def centrifugo_endpoint(services: SessionServices) -> CentrifugoEndpoint | None:
    """The server's Centrifugo endpoint (`ws.protocol_class`), None when `centrifugo.enabled` is false."""
    return CentrifugoEndpoint(services) if services.config.centrifugo.enabled else None


class CentrifugoLink:
    """One connection's side of its Centrifugo session (`client_session.Link`) and of the ping wheel
    (`ws_keepalive.KeptAlive`)."""

    __slots__ = (
        "endpoint",
        "proto",
        "codec",
        "framer",
        "deflater",
        "request",
        "session",
        "ping_payload",
        "ping_sent_at",
        "ping_rtt",
        "transport",
        "stale_timer",
    )

    def __init__(self, endpoint: CentrifugoEndpoint, proto: WebSocketProtocol, codec_name: str, request: Request) -> None:
        self.endpoint = endpoint
        self.proto = proto
        self.codec = endpoint.codecs[codec_name]
        self.framer = endpoint.framers[codec_name]
        #: the compressor of this codec's frames for the window the handshake negotiated; None: plain
        self.deflater = proto.service.framers.for_frames(self.codec.variant, proto.window_bits)
        self.request = request
        self.transport: asyncio.Transport = proto.transport
        self.ping_payload: bytes | None = None
        self.ping_sent_at = self.ping_rtt = 0.0
        self.session = CentrifugoSession(endpoint.services, self.codec, self)
        self.stale_timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            endpoint.config.connect_timeout_s, self._stale
        )

    @property
    def peer(self) -> tuple[str, int] | None:
        return self.proto.peer

    @property
    def closed(self) -> bool:
        return self.proto.state is not WS_OPEN or self.transport.is_closing()

    def received(self, payload: bytes, text: bool) -> None:
        self.session.received(payload, text)

    def header_values(self, name: str) -> list[str]:
        return self.request.headers.get_all(name)

    def write_replies(self, reply: bytes) -> None:
        if not self.closed:
            payload = self.codec.join([reply])
            frame = text_frame_header(len(payload), self.codec.frame_first) + payload
            data = frame if self.deflater is None else self.deflater.deflated(frame, False)
            ws_counters.payload_bytes += len(payload)
            ws_counters.wire_bytes += len(data)
            self.transport.write(data)

    def close(self, code: int, reason: str) -> None:
        opened = self.session.session
        if opened is not None and opened.live:
            opened.close(code, reason)  # the staged frames go first (`CentrifugoConnection.kick`)
            return
        self._stop()
        self.proto.close_with(code, reason)
        self.proto.forget()

    def pause(self) -> None:
        self.transport.pause_reading()

    def resume(self) -> None:
        if not self.closed:
            self.proto.resume_input()

    @property
    def busy(self) -> bool:
        return self.session.busy

    @property
    def waiting(self) -> bool:
        return self.session.waiting

    def step(self) -> None:
        self.session.step()

    def connection(self, session: ClientSession) -> CentrifugoConnection:
        return CentrifugoConnection(
            session,
            self.proto,
            self.framer,
            self.deflater,
            wire_variant(self.codec.variant, self.proto.window_bits),
            self.session.answers,
        )

    def connected(self) -> None:
        self._stop_stale()
        self.endpoint.keepalive.start(self)

    def pong(self) -> None:
        if self.ping_payload is not None:
            self.endpoint.keepalive.pong(self, self.ping_payload)

    def lost(self) -> None:
        self._stop()

    def _stop(self) -> None:
        self._stop_stale()
        self.endpoint.keepalive.stop(self)

    def _stop_stale(self) -> None:
        if self.stale_timer is not None:
            self.stale_timer.cancel()
            self.stale_timer = None

    def _stale(self) -> None:
        self.stale_timer = None
        if self.session.session is None and not self.closed:
            self.close(codes.STALE, "stale: no connect command in time (centrifugo.connect_timeout_s)")

    # -- the ping wheel's calls ------------------------------------------------------------------------------

    def can_ping(self) -> bool:
        return not self.closed

    def frames_flowed(self) -> bool:
        return False  # the SDKs time their pings, not the data: always pinged

    def write_ping(self, payload: bytes) -> None:
        self.write_replies(self.codec.ping)

    def keepalive_timed_out(self) -> None:
        if not self.closed:
            self.close(codes.NO_PONG, "no pong")


class CentrifugoConnection(WSConnection):
    """The scheduler's side of a Centrifugo client: its batches converted (module docstring)."""

    __slots__ = ("converter", "deflater", "direct_wire", "answers", "own_frame", "own")

    def __init__(
        self,
        session: ClientSession,
        proto: WebSocketProtocol,
        framer: CentrifugoFramer,
        deflater: FrameDeflater | None,
        variant: int,
        answers: Answers,
    ) -> None:
        super().__init__(session, proto)
        self.wire_variant = self.sink.variant = variant
        self.converter = framer
        #: the compressed form of the converted frames (permessage-deflate negotiated), else None
        self.deflater = deflater
        #: the converted frame `direct_fd` let go to the fan-out writer: what `wire` gives for it (a client
        #: gets one batch per cycle, so the crowd's first member holds its frame's bytes)
        self.direct_wire = b""
        #: how to answer the client's commands (its Centrifugo session's table, gateway/centrifugo/client_frames.py)
        self.answers = answers
        #: the last frame of this client's own answers and its conversion (which took their table entries):
        #: `direct_fd` and `deliver` of one batch convert it once
        self.own_frame: bytes | None = None
        self.own: Converted | None = None

    def deliver(self, batch: Batch, frame: bytes) -> Delivered:
        converted = self.own
        if converted is None or frame is not self.own_frame:
            converted = self.converter.convert(batch.entries, frame, self.answers)
        else:  # converted by `direct_fd`, its answers taken from the table then
            self.own_frame = self.own = None
        if converted.lost:
            self._drop_lost(converted.lost)
        if self.closed:
            return BLOCKED
        frame = converted.wire
        self.counted(len(batch.entries), len(frame))
        if not frame:
            return DONE
        if self.transport.is_closing() or self.proto.state is not WS_OPEN:
            return BLOCKED
        data = frame if self.deflater is None else self.deflater.deflated(frame, converted.shared)
        ws_counters.payload_bytes += len(frame) - payload_offset(frame)
        ws_counters.wire_bytes += len(data)
        return self.write_batch((data,), len(data), batch.more)

    def direct_fd(self, batch: Batch, frame: bytes) -> int:
        converted = self.converter.convert(batch.entries, frame, self.answers)
        if not converted.shared:  # one client's answers: `deliver` writes what was converted here
            self.own_frame, self.own = frame, converted
            return -1
        if converted.lost or not converted.wire:
            return -1
        self.direct_wire = converted.wire
        return super().direct_fd(batch, frame)

    def gathered_wire(self, entry: bytes, frame: bytes, sinks: list[Sink]) -> bytes:
        # converted once for the crowd; the engine counted our frame's size, the client gets the converted one's
        converted = self.converter.convert([entry], frame, self.answers)
        if converted.lost:
            for sink in sinks:
                sink.owner._drop_lost(converted.lost)
        if extra := len(converted.wire) - len(frame):
            for sink in sinks:
                sink.bytes += extra
        if not converted.wire:
            return b""
        self.direct_wire = converted.wire
        return self.wire(frame, len(sinks))

    def wire(self, frame: bytes, count: int) -> bytes:
        converted = self.direct_wire
        data = converted if self.deflater is None else self.deflater.deflated(converted, True)
        ws_counters.payload_bytes += (len(converted) - payload_offset(converted)) * count
        ws_counters.wire_bytes += len(data) * count
        return data

    def _drop_lost(self, topics: tuple[str, ...]) -> None:
        """Subscriptions an `unsubscribe` push ended (a loss): dropped after this cycle, so that the SDK's
        subscribe again finds none."""
        asyncio.get_running_loop().call_soon(self._unsubscribe, topics)

    def _unsubscribe(self, topics: tuple[str, ...]) -> None:
        session = self.session
        if not session.live:
            return
        services = session.services
        client_id = self.identity.client_id
        subs = services.topics.client(client_id).subs
        for topic in topics:
            if topic in subs:
                services.catalog.unsubscribe(client_id, topic, request_id=LOST_ID)

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        described["transport"] = "centrifugo"
        return described
