"""One frame written to many caught-up clients in one call: the fan-out writer (`_fanwrite.c`, or its twin).

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

Only plain TCP sockets qualify: bytes written under a TLS transport would bypass the encryption.

Two implementations, one interface, chosen here at import: the compiled `_fanwrite.Sender`, or its Python twin
(`fanwrite_py.Sender`: one send per socket too, in `submit`, no thread) where the module is not built (no C
compiler at install) or FANOUT_PURE_PYTHON is set (read at import, as core/native.py does for the core).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from . import fanwrite_py

if TYPE_CHECKING:
    from . import _fanwrite


def _pure_requested() -> bool:
    return os.environ.get("FANOUT_PURE_PYTHON", "") not in ("", "0")


def _choose() -> tuple[type[fanwrite_py.Sender] | type[_fanwrite.Sender], str]:
    """(the Sender class, what `BUILD` says of it)."""
    if _pure_requested():
        return fanwrite_py.Sender, "python (FANOUT_PURE_PYTHON)"
    try:
        from . import _fanwrite
    except ImportError:  # built without a compiler (a warning at install)
        return fanwrite_py.Sender, "python (not built)"
    return _fanwrite.Sender, "compiled"


#: the class the scheduler sends with; BUILD is printed by `gateway serve` at start (`fan-out writer: ...`)
Sender, BUILD = _choose()


def raw_fd(transport: asyncio.BaseTransport) -> int:
    """The descriptor to write the transport's socket directly, or -1: no socket, or TLS (the socket then
    carries records, not our bytes)."""
    if transport.get_extra_info("sslcontext") is not None:
        return -1
    if transport.get_extra_info("ssl_object") is not None:
        return -1
    sock = transport.get_extra_info("socket")
    return -1 if sock is None else int(sock.fileno())
