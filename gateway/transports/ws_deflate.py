"""permessage-deflate (RFC 7692) on `/ws` and at `centrifugo.path`, compressed once per frame for every subscriber.

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

from ..wsframes import COMPRESSED_TEXT, RSV1, FrameCache, payload_offset, text_frame_header
from .ws_counters import ws_counters

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
_OFFER = (
    b"GET / HTTP/1.1\r\nHost: parser\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: cGFyc2VyIG9mIGZyYW1lcw==\r\n"
    b"Sec-WebSocket-Extensions: permessage-deflate; server_no_context_takeover; client_no_context_takeover\r\n\r\n"
)


def inflating_parser(max_size: int, logger: logging.Logger) -> ServerProtocol:
    """A frame parser (state OPEN) that inflates the messages a client compressed, made by a handshake of its
    own through websockets' public API, which negotiates the extension. Without context takeover it holds no
    state between two messages, so, like a plain parser, it serves any connection that negotiated deflate
    and goes back to the server's pool between reads (gateway/transports/ws_service.py, `ParserPool`). It inflates
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


class Deflater:
    """One window's compressor, shared by the framers of that window (`/ws`'s and Centrifugo's): making one
    costs 5x the compression of a small frame, and it holds ~256 KiB. A full flush after each payload ends
    its dependence on what came before (no context takeover)."""

    __slots__ = ("compressor",)

    def __init__(self, window_bits: int) -> None:
        self.compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, -window_bits)

    def compress(self, payload: bytes | memoryview) -> bytes | None:
        """The payload as a compressed message's body; None when it would not shrink (sent as it is)."""
        body = self.compressor.compress(payload) + self.compressor.flush(zlib.Z_FULL_FLUSH)
        if body.endswith(FLUSH_TAIL):
            body = body[:-4]
        smaller = len(body) < len(payload)
        ws_counters.deflated_frames += 1
        ws_counters.deflate_input_bytes += len(payload)
        ws_counters.deflate_output_bytes += len(body) if smaller else len(payload)
        return body if smaller else None


class DeflateFramer:
    """Compressed frames for the clients of one window size, by payload: each payload compressed once."""

    __slots__ = ("plain", "min_bytes", "deflater", "frames", "payload", "frame")

    def __init__(self, deflater: Deflater, min_bytes: int, plain: PlainFramer) -> None:
        self.plain = plain
        self.min_bytes = min_bytes
        self.deflater = deflater
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
        body = self.deflater.compress(payload)
        if body is None:  # incompressible: sent as it is
            frame = text_frame_header(len(payload)) + payload
        else:
            frame = text_frame_header(len(body), COMPRESSED_TEXT) + body
        self.frames.put(payload, frame)
        return frame


class FrameDeflater:
    """Compressed forms of whole frames another protocol built (Centrifugo's converted frames, text or binary,
    gateway/transports/ws_centrifugo.py), for the clients of one form and window: each frame many clients
    get compressed once. Frames whose payload is below `min_bytes`, and those that would not shrink, are
    given back as they are (RSV1 clear)."""

    __slots__ = ("min_bytes", "deflater", "frames", "last", "last_sent")

    def __init__(self, deflater: Deflater, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.deflater = deflater
        self.frames: FrameCache[bytes] = FrameCache(CACHE_BYTES)
        self.last = self.last_sent = b""

    def deflated(self, frame: bytes, shared: bool) -> bytes:
        """What goes on the wire for `frame`; `shared`: other clients may get the same frame (kept for them),
        else it is one client's (compressed for it alone, not kept)."""
        if frame is self.last:
            return self.last_sent
        offset = payload_offset(frame)
        if len(frame) - offset < self.min_bytes:
            return frame
        sent = self.frames.items.get(frame)
        if sent is None:
            body = self.deflater.compress(memoryview(frame)[offset:])
            sent = frame if body is None else text_frame_header(len(body), frame[0] | RSV1) + body
            if shared:
                self.frames.put(frame, sent)
        if shared:
            self.last, self.last_sent = frame, sent
        return sent


class Framers:
    """A server's framers: the plain one and one per negotiated window size for `/ws`, one per form and
    window for the frames of other protocols (`for_frames`), all of one window sharing its compressor."""

    __slots__ = ("plain", "min_bytes", "deflaters", "deflate", "frame_deflaters")

    def __init__(self, min_bytes: int) -> None:
        self.plain = PlainFramer()
        self.min_bytes = min_bytes
        self.deflaters: dict[int, Deflater] = {}
        self.deflate: dict[int, DeflateFramer] = {}
        self.frame_deflaters: dict[tuple[int, int], FrameDeflater] = {}

    def for_window(self, window_bits: int) -> PlainFramer | DeflateFramer:
        if not window_bits:
            return self.plain
        framer = self.deflate.get(window_bits)
        if framer is None:
            framer = self.deflate[window_bits] = DeflateFramer(self.deflater(window_bits), self.min_bytes, self.plain)
        return framer

    def for_frames(self, form: int, window_bits: int) -> FrameDeflater | None:
        """The compressor of another protocol's frames of one `form` (Centrifugo's codec) for one window; None
        when deflate was not negotiated (window 0)."""
        if not window_bits:
            return None
        key = (form, window_bits)
        framer = self.frame_deflaters.get(key)
        if framer is None:
            framer = self.frame_deflaters[key] = FrameDeflater(self.deflater(window_bits), self.min_bytes)
        return framer

    def deflater(self, window_bits: int) -> Deflater:
        deflater = self.deflaters.get(window_bits)
        if deflater is None:
            deflater = self.deflaters[window_bits] = Deflater(window_bits)
        return deflater
