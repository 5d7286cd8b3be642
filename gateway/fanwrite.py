"""One frame written to many caught-up clients in one call: the compiled fan-out writer (`_fanwrite.c`).

When one message reaches a crowd, most of its subscribers are caught up: their batch is that one message,
nothing is staged for them and their transport's buffer is empty. For those the scheduler collects the
sockets and `send_each` writes the same bytes to all of them without returning to Python between sockets
(the per-connection path costs a few microseconds of Python each, about as much as the kernel's send). A
socket that takes less than the whole frame (its buffer full) or fails gets the rest through its transport,
which buffers it or reports the error exactly as for its own write, so the order of bytes is kept.

Only plain TCP sockets qualify: bytes written under a TLS transport would bypass the encryption. Without a C
compiler at install the module is missing and every write goes through the transport, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

SendEach = Callable[[list[int], bytes], list[tuple[int, int]]]

send_each: SendEach | None
try:
    from ._fanwrite import send_each as compiled_send_each
except ImportError:  # built without a compiler (a warning at install): the transports write everything
    send_each = None
else:
    send_each = compiled_send_each

#: printed by `gateway serve` at start (`fan-out writer: ...`)
BUILD = "compiled" if send_each is not None else "not built (every frame goes through its transport)"


def raw_fd(transport: asyncio.BaseTransport) -> int:
    """The descriptor to write the transport's socket directly, or -1: no compiled writer, no socket, or
    TLS (the socket then carries records, not our bytes)."""
    if send_each is None or transport.get_extra_info("sslcontext") is not None:
        return -1
    if transport.get_extra_info("ssl_object") is not None:
        return -1
    sock = transport.get_extra_info("socket")
    return -1 if sock is None else int(sock.fileno())
