"""permessage-deflate (RFC 7692) on `/ws`, compressed once per frame for every subscriber.

The extension is negotiated with no context takeover either way: each message is compressed on its own, so a
frame many clients get is compressed once and the same bytes go to all of them, as the entries are encoded
once (docs/design/shared-rings.md §4). A client that asks the server for a smaller window
(`server_max_window_bits`) gets frames compressed with that window: one compression per (frame, window).
Frames below `websocket.compression_min_bytes`, and frames that would not shrink, go uncompressed (RSV1
clear), which RFC 7692 allows per message.

Inbound, websockets' own extension (the one the handshake negotiated) inflates what the client compressed,
within the frame and message bounds applied to the inflated size: a deflate bomb is refused with 1009 after
inflating at most that much.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

from websockets.extensions import Extension
from websockets.extensions.permessage_deflate import PerMessageDeflate, ServerPerMessageDeflateFactory
from websockets.http11 import Request
from websockets.protocol import OPEN
from websockets.server import ServerProtocol

from .ws_counters import ws_counters
from .wsframes import COMPRESSED_TEXT, FrameCache, text_frame_header

#: zlib's default level: on a 600-byte batch the same time as level 1 (~12 µs, paid once per distinct frame)
#: and a few percent smaller
LEVEL = 6
#: payload bytes of the frames a framer keeps compressed (the clients of one cycle get the same few frames in
#: any order); past it the cache starts again
CACHE_BYTES = 1 << 20
#: the end of a sync flush, which the sender drops and the receiver adds back (RFC 7692 §7.2.1)
FLUSH_TAIL = b"\x00\x00\xff\xff"


def offer_factory() -> ServerPerMessageDeflateFactory:
    """What the handshake accepts of a client's offer: no context takeover either way, whatever it asked
    (RFC 7692 §7.1.1: the server may add `client_no_context_takeover` to its answer)."""
    return ServerPerMessageDeflateFactory(server_no_context_takeover=True, client_no_context_takeover=True)


#: the request of `inflating_parser`'s own handshake: an offer of deflate without context takeover
_OFFER = (b"GET / HTTP/1.1\r\nHost: parser\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
          b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: cGFyc2VyIG9mIGZyYW1lcw==\r\n"
          b"Sec-WebSocket-Extensions: permessage-deflate; server_no_context_takeover; client_no_context_takeover\r\n\r\n")


def inflating_parser(max_size: int, logger: logging.Logger) -> ServerProtocol:
    """A frame parser (state OPEN) that inflates the messages a client compressed, made by a handshake of its
    own through websockets' public API, which negotiates the extension. Without context takeover it holds no
    state between two messages, so, like a plain parser, it serves any connection that negotiated deflate
    and goes back to the server's pool between reads (gateway/transports/ws.py, `ParserPool`). It inflates
    with the largest window, which reads whatever window the client compressed with."""
    parser = ServerProtocol(extensions=[offer_factory()], max_size=max_size, logger=logger)
    parser.receive_data(_OFFER)
    (request,) = parser.events_received()
    assert isinstance(request, Request)
    parser.send_response(parser.accept(request))
    parser.data_to_send()
    assert parser.state is OPEN and negotiated_window(parser.extensions)
    return parser


def negotiated_window(extensions: Sequence[Extension]) -> int:
    """The window bits our frames to this client are compressed with; 0 when it did not negotiate deflate."""
    for extension in extensions:
        if isinstance(extension, PerMessageDeflate):
            return extension.local_max_window_bits
    return 0


class PlainFramer:
    """The WebSocket frame of the last payload: the clients of one cycle mostly get the same payload object
    in a row, so header and payload are joined once for all of them and each write is one buffer."""

    __slots__ = ("payload", "frame")

    def __init__(self) -> None:
        self.payload = b""
        self.frame = text_frame_header(0)

    def framed(self, payload: bytes) -> bytes:
        if payload is not self.payload:
            self.frame = text_frame_header(len(payload)) + payload
            self.payload = payload
        return self.frame


class DeflateFramer:
    """Compressed frames for the clients of one window size, by payload: each payload compressed once."""

    __slots__ = ("plain", "min_bytes", "compressor", "frames", "payload", "frame")

    def __init__(self, window_bits: int, min_bytes: int, plain: PlainFramer) -> None:
        self.plain = plain
        self.min_bytes = min_bytes
        # one compressor for every frame: a full flush after each ends its dependence on what came before
        # (no context takeover), and making a compressor costs 5x the compression of a small frame
        self.compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, -window_bits)
        self.frames: FrameCache[bytes] = FrameCache(CACHE_BYTES)
        self.payload = b""
        self.frame = text_frame_header(0)

    def framed(self, payload: bytes) -> bytes:
        if payload is self.payload:
            return self.frame
        if len(payload) < self.min_bytes:
            return self.plain.framed(payload)
        frame = self.frames.items.get(payload)
        if frame is None:
            frame = self._compressed(payload)
        self.payload, self.frame = payload, frame
        return frame

    def _compressed(self, payload: bytes) -> bytes:
        body = self.compressor.compress(payload) + self.compressor.flush(zlib.Z_FULL_FLUSH)
        if body.endswith(FLUSH_TAIL):
            body = body[:-4]
        if len(body) < len(payload):
            frame = text_frame_header(len(body), COMPRESSED_TEXT) + body
        else:  # incompressible: sent as it is
            frame = text_frame_header(len(payload)) + payload
        ws_counters.deflated_frames += 1
        ws_counters.deflate_input_bytes += len(payload)
        ws_counters.deflate_output_bytes += min(len(body), len(payload))
        self.frames.put(payload, frame)
        return frame


class Framers:
    """A server's framers: the plain one and one per negotiated window size."""

    __slots__ = ("plain", "min_bytes", "deflate")

    def __init__(self, min_bytes: int) -> None:
        self.plain = PlainFramer()
        self.min_bytes = min_bytes
        self.deflate: dict[int, DeflateFramer] = {}

    def for_window(self, window_bits: int) -> PlainFramer | DeflateFramer:
        if not window_bits:
            return self.plain
        framer = self.deflate.get(window_bits)
        if framer is None:
            framer = self.deflate[window_bits] = DeflateFramer(window_bits, self.min_bytes, self.plain)
        return framer
