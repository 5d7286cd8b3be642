"""WebSocket frame bytes a server writes itself, and the frame boundaries of what a client sends
(gateway/transports/ws.py, and the load tool's bare reference server, which imports this module alone)."""

from __future__ import annotations

import struct
from typing import Generic, TypeVar

V = TypeVar("V")

#: the bit of a first byte that marks the frame's payload compressed (RFC 7692 §6)
RSV1 = 0x40
#: first byte of a final text frame, and of one whose payload is compressed
TEXT = 0x81
COMPRESSED_TEXT = TEXT | RSV1


def text_frame_header(length: int, first: int = TEXT) -> bytes:
    """Header of an unmasked server-to-client text frame (RFC 6455 §5.2)."""
    if length < 126:
        return bytes((first, length))
    if length < 65536:
        return struct.pack("!BBH", first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


def payload_offset(frame: bytes) -> int:
    """Where the payload of a whole frame starts: the size of its header."""
    size = _header_size(frame)
    assert size is not None, "a whole frame has a header"
    return size


def frames_fed(left: int, head: bytes, data: bytes) -> tuple[int, bytes]:
    """Where a stream of client frames stands once `data` follows: (bytes of the current frame still to come,
    the part of a frame header read so far). (0, b"") is a frame boundary. Only the headers are read (RFC
    6455 §5.2: 2 bytes, the extended length, the mask); the payloads are skipped, compressed or not."""
    pos, size = 0, len(data)
    while pos < size:
        if left:
            step = min(left, size - pos)
            left -= step
            pos += step
            continue
        known = head + data[pos : pos + 14]  # a header has at most 14 bytes
        need = _header_size(known)
        if need is None or len(known) < need:
            return 0, known  # the rest of `data` is part of a header
        pos += need - len(head)
        head = b""
        left = _payload_length(known)
    return left, head


def _header_size(head: bytes) -> int | None:
    if len(head) < 2:
        return None
    length = head[1] & 0x7F
    return 2 + (2 if length == 126 else 8 if length == 127 else 0) + (4 if head[1] & 0x80 else 0)


def _payload_length(head: bytes) -> int:
    length = head[1] & 0x7F
    if length == 126:
        return int.from_bytes(head[2:4], "big")
    if length == 127:
        return int.from_bytes(head[2:10], "big")
    return length


class FrameCache(Generic[V]):
    """What was made of a frame (or an entry), by its bytes, for the next clients that get the same bytes:
    read `items` directly; `put` keeps at most `limit` bytes of keys, past which the cache starts again (the
    clients of one cycle get the same few frames in any order)."""

    __slots__ = ("items", "size", "limit")

    def __init__(self, limit: int) -> None:
        self.items: dict[bytes, V] = {}
        self.size = 0
        self.limit = limit

    def put(self, key: bytes, value: V) -> None:
        if self.size >= self.limit:
            self.items.clear()
            self.size = 0
        self.items[key] = value
        self.size += len(key)
