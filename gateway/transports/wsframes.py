"""WebSocket frame bytes a server writes itself (gateway/transports/ws.py, and the load tool's bare reference server,
which imports this module alone, not the gateway)."""

from __future__ import annotations

import struct

#: first byte of a final text frame, and of one whose payload is compressed (RSV1, RFC 7692 §6)
TEXT = 0x81
COMPRESSED_TEXT = 0xC1


def text_frame_header(length: int, first: int = TEXT) -> bytes:
    """Header of an unmasked server-to-client text frame (RFC 6455 §5.2)."""
    if length < 126:
        return bytes((first, length))
    if length < 65536:
        return struct.pack("!BBH", first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


def client_frame_size(payload_length: int) -> int:
    """Bytes of a masked client-to-server frame with this payload on the wire, its length in the fewest bytes
    (RFC 6455 §5.2). A peer that encodes a length in more bytes than needed makes a count by this larger than
    what was read: such a count never reaches zero too early (gateway/transports/ws.py, `_park`)."""
    if payload_length < 126:
        return 6 + payload_length
    if payload_length < 65536:
        return 8 + payload_length
    return 14 + payload_length
