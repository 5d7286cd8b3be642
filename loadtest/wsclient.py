"""A light WebSocket client: websockets' sans-I/O ``ClientProtocol`` under a plain ``asyncio.Protocol``.

No task and no queue per connection: bytes from the socket go straight through the parser, and the
complete messages of one read are handed to the owner in one call, with the time of that read. This is
what lets one process hold thousands of subscribers (``python -m loadtest wsbench`` measures it against the
websockets asyncio client). Compression is never offered: fan-out servers share one encoded frame.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

#: largest message accepted; batches are bounded by the server's cycle budget, far below this
MAX_MESSAGE = 16 * 2**20
#: after our close frame, how long to wait for the server to close TCP before we do
CLOSE_TIMEOUT = 1.0


class Listener(Protocol):
    """What the owner of a :class:`WsClient` implements. Callbacks run on the event loop, must not block."""

    def ws_open(self) -> None: ...

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None: ...

    def ws_closed(self, reason: str) -> None: ...


class WsClient(asyncio.Protocol):
    """One WebSocket connection. Create it with :func:`connect`.

    ``ws_messages`` gets the data of every complete text or binary message of one socket read, in order,
    with ``time.time_ns()`` taken once when that read arrived.
    """

    def __init__(self, url: str, listener: Listener) -> None:
        self.listener = listener
        self.protocol = ClientProtocol(parse_uri(url), max_size=MAX_MESSAGE)
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False
        self._fragments: list[bytes] = []

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop transports are not asyncio.Transport subclasses)
        self.protocol.send_request(self.protocol.connect())
        self._flush()

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        protocol = self.protocol
        protocol.receive_data(data)
        self._flush()
        messages: list[bytes] = []
        for event in protocol.events_received():
            if type(event) is Frame:
                opcode = event.opcode
                if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
                    if event.fin:
                        messages.append(event.data)
                    else:
                        self._fragments = [event.data]
                elif opcode is Opcode.CONT:
                    self._fragments.append(event.data)
                    if event.fin:
                        messages.append(b"".join(self._fragments))
                        self._fragments = []
                elif opcode is Opcode.CLOSE:
                    close = protocol.close_rcvd
                    self._closing(f"close {close.code} {close.reason}" if close else "close")
            elif isinstance(event, Response):
                self._handshake_done()
        if messages:
            self.listener.ws_messages(messages, now)
        if protocol.close_expected() and self.transport is not None:
            asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, self.transport.close)

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        self._flush()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc or ConnectionError("closed during the handshake"))
        self._closing(f"lost: {exc}" if exc else "eof")

    # Owner's verbs

    def send_text(self, data: bytes) -> None:
        self.protocol.send_text(data)
        self._flush()

    def pause(self) -> None:
        """Stop reading: the kernel buffers fill, then the server sees a stalled client."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        """Send a close frame and drop the connection once it is written."""
        if self.transport is None or self.closed:
            return
        try:
            self.protocol.send_close(1000)
            self._flush()
        except Exception:  # already closing: nothing more to say
            pass
        self.transport.close()

    # Internals

    def _flush(self) -> None:
        if self.transport is None:
            return
        for chunk in self.protocol.data_to_send():
            if chunk:
                self.transport.write(chunk)
            elif self.transport.can_write_eof():
                self.transport.write_eof()

    def _handshake_done(self) -> None:
        if self.opened.done():
            return
        if self.protocol.handshake_exc is not None:
            self.opened.set_exception(self.protocol.handshake_exc)
            return
        self.opened.set_result(None)
        self.listener.ws_open()

    def _closing(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self.opened.done() and self.opened.exception() is None:
            self.listener.ws_closed(reason)


async def connect(host: str, port: int, path: str, listener: Listener, timeout: float = 10.0) -> WsClient:
    """Open a connection to ``ws://host:port/path`` and wait for the handshake; raises on failure."""
    loop = asyncio.get_running_loop()
    url = f"ws://{host}:{port}{path}"
    _transport, client = await asyncio.wait_for(
        loop.create_connection(lambda: WsClient(url, listener), host, port), timeout)
    try:
        await asyncio.wait_for(asyncio.shield(client.opened), timeout)
    except BaseException:
        if client.transport is not None:
            client.transport.abort()
        raise
    return client
