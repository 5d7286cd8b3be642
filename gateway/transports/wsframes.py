"""WebSocket frame bytes a server writes itself (gateway/transports/ws.py, and the load tool's bare reference server,
which imports this module alone, not the gateway)."""

from __future__ import annotations

import struct


def text_frame_header(length: int) -> bytes:
    """Header of an unmasked server-to-client text frame (RFC 6455 §5.2)."""
    if length < 126:
        return bytes((0x81, length))
    if length < 65536:
        return struct.pack("!BBH", 0x81, 126, length)
    return struct.pack("!BBQ", 0x81, 127, length)
