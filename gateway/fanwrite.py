"""One frame written to many caught-up clients in one call: the compiled fan-out writer (`_fanwrite.c`).

When one message reaches a crowd, most of its subscribers are caught up: their batch is that one message,
nothing is staged for them and their transport's buffer is empty. For those the scheduler collects the
sockets and the same bytes go to all of them without returning to Python between sockets (the
per-connection path costs a few microseconds of Python each, about as much as the kernel's send).

`Sender` does those sends on a thread of its own, on the other core, while the scheduler prepares the next
slice of the crowd; at the cycle's end the scheduler's thread sends what is still queued alongside it and
waits (`wait`). Nothing else writes those sockets in between: the scheduler runs no loop callback until the
wait returns. A socket that takes less than the whole frame (its buffer full) or fails gets the rest
through its transport, which buffers it or reports the error exactly as for its own write, so the order of
bytes is kept.

Only plain TCP sockets qualify: bytes written under a TLS transport would bypass the encryption. Without a C
compiler at install the module is missing and every write goes through the transport, as before.
"""

from __future__ import annotations

import asyncio

Sender: type[_fanwrite.Sender] | None
try:
    from . import _fanwrite
except ImportError:  # built without a compiler (a warning at install): the transports write everything
    Sender = None
else:
    Sender = _fanwrite.Sender

#: printed by `gateway serve` at start (`fan-out writer: ...`)
BUILD = "compiled" if Sender is not None else "not built (every frame goes through its transport)"


def raw_fd(transport: asyncio.BaseTransport) -> int:
    """The descriptor to write the transport's socket directly, or -1: no compiled writer, no socket, or
    TLS (the socket then carries records, not our bytes)."""
    if Sender is None or transport.get_extra_info("sslcontext") is not None:
        return -1
    if transport.get_extra_info("ssl_object") is not None:
        return -1
    sock = transport.get_extra_info("socket")
    return -1 if sock is None else int(sock.fileno())
