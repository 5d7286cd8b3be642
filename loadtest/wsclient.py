"""A light WebSocket client: websockets' sans-I/O ``ClientProtocol`` under a plain ``asyncio.Protocol``.

No task and no queue per connection: bytes from the socket go straight through the parser, and the
complete messages of one read are handed to the owner in one call, with the time of that read. This is
what lets one process hold thousands of subscribers (``python -m loadtest wsbench`` measures it against the
websockets asyncio client). permessage-deflate is offered only when asked (``compression``), with no context
takeover either way, so each compressed frame inflates on its own.

websockets does the handshake, the control frames and any error; the server's plain data frames are cut
by the client itself (``WsClient._split``, ~0.35 us a frame against websockets' ~1.9 us), so that one load
process can drive a fan-out server without measuring its own parser.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Protocol, cast

from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from .aio import within

#: largest message accepted; batches are bounded by the server's cycle budget, far below this
MAX_MESSAGE = 16 * 2**20
#: longest response head waited for before websockets is handed it (its own limit refuses it)
MAX_HEAD = 64 * 2**10
#: after our close frame, how long to wait for the server to close TCP before we do
CLOSE_TIMEOUT = 1.0
#: the end of a sync flush, which the server drops from a compressed message (RFC 7692 §7.2.1)
FLUSH_TAIL = b"\x00\x00\xff\xff"


class _Inflater:
    """Inflates the process's compressed messages. Negotiated without context takeover, no message refers to
    another, so one decompressor serves every connection (one per connection would hold a 32 KiB window
    each); and the clients of a crowd get the same compressed frame, inflated once while it repeats (the
    load generator must cost less than the server it measures)."""

    def __init__(self) -> None:
        self.decompressor = zlib.decompressobj(-15)
        self.last_in = b""
        self.last_out = b""

    def inflate(self, payload: bytes) -> bytes:
        if payload != self.last_in:
            self.last_out = self.decompressor.decompress(payload + FLUSH_TAIL)
            self.last_in = payload
        return self.last_out


INFLATER = _Inflater()


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

    def __init__(self, url: str, listener: Listener, compression: bool = False) -> None:
        self.listener = listener
        offer = (
            [
                ClientPerMessageDeflateFactory(
                    server_no_context_takeover=True, client_no_context_takeover=True, client_max_window_bits=None
                )
            ]
            if compression
            else None
        )
        self.protocol = ClientProtocol(parse_uri(url), extensions=offer, max_size=MAX_MESSAGE)
        #: permessage-deflate was negotiated: frames with RSV1 are inflated here
        self.inflating = False
        #: bytes read from the socket (the server's TCP payload to this client, the handshake's answer included)
        self.bytes_received = 0
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False
        self._fragments: list[bytes] = []
        #: data frames are cut by :meth:`_split`, not by websockets (set once the handshake is done)
        self._direct = False
        #: the tail of the last read, a frame not yet complete, and the bytes that frame needs in all
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._need = 0
        self._close_timer = False
        #: the response's head, until its blank line
        self._head = bytearray()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)
        self.protocol.send_request(self.protocol.connect())
        self._flush()

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        self.bytes_received += len(data)
        messages = self._split(data) if self._direct else self._handshake(data)
        if messages:
            self.listener.ws_messages(messages, now)
        if self.protocol.close_expected() and self.transport is not None and not self._close_timer:
            self._close_timer = True
            asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, self.transport.close)

    def _handshake(self, data: bytes) -> list[bytes]:
        """websockets reads the response's head alone; once open, the frames after it go to :meth:`_split`."""
        if self.protocol.state is not State.CONNECTING:  # failed, or handed back to websockets for good
            return self._through_websockets(data)
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD:  # websockets says what is wrong with it
                return self._through_websockets(bytes(self._head))
            return []
        head, rest = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
        self._head = bytearray()
        messages = self._through_websockets(head)
        if self.protocol.state is State.OPEN:
            self._direct = True
            return messages + self._split(rest) if rest else messages
        return messages + self._through_websockets(rest) if rest else messages

    def _through_websockets(self, data: bytes) -> list[bytes]:
        """Every event of websockets' parser: the handshake, control frames, anything unusual."""
        protocol = self.protocol
        protocol.receive_data(data)
        self._flush()
        messages: list[bytes] = []
        for event in protocol.events_received():
            if type(event) is Frame:
                if event.opcode is Opcode.CLOSE:
                    close = protocol.close_rcvd
                    self._closing(f"close {close.code} {close.reason}" if close else "close")
                else:
                    self._data_frame(event.opcode, event.fin, bytes(event.data), messages)  # bytes: no copy
            elif isinstance(event, Response):
                self._handshake_done()
        return messages

    def _data_frame(self, opcode: int, fin: bool, payload: bytes, messages: list[bytes]) -> None:
        """A text, binary or continuation frame: a message once its last fragment is in (others: ignored,
        websockets answered them)."""
        if opcode == Opcode.TEXT or opcode == Opcode.BINARY:
            if fin:
                messages.append(payload)
            else:
                self._fragments = [payload]
        elif opcode == Opcode.CONT:
            self._fragments.append(payload)
            if fin:
                messages.append(b"".join(self._fragments))
                self._fragments = []

    def _split(self, data: bytes) -> list[bytes]:
        """The messages of the complete frames in ``data`` (after what an earlier read left over).

        Plain data frames from the server (unmasked, no extension bits) are cut here (why: the module's
        docstring); a control frame goes to websockets whole, and anything else hands websockets the rest
        of the stream for good, so errors are still answered as it answers them.
        """
        if self._pending:
            self._pending.append(data)
            self._pending_len += len(data)
            if self._pending_len < self._need:
                return []
            data = b"".join(self._pending)
            self._pending, self._pending_len, self._need = [], 0, 0
        messages: list[bytes] = []
        pos, end = 0, len(data)
        while end - pos >= 2:
            first, second = data[pos], data[pos + 1]
            length, head = second & 0x7F, 2
            if second & 0x80 or (first & 0x70 and not (first == 0xC1 and self.inflating)):
                # masked, or an extension bit we do not handle: websockets answers it
                self._direct = False
                return messages + self._through_websockets(data[pos:])
            if length == 126:
                if end - pos < 4:
                    break
                length, head = int.from_bytes(data[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if end - pos < 10:
                    break
                length, head = int.from_bytes(data[pos + 2 : pos + 10], "big"), 10
            if length > MAX_MESSAGE:
                self._direct = False
                return messages + self._through_websockets(data[pos:])
            stop = pos + head + length
            if stop > end:
                self._need = stop - pos
                break
            if first == 0x81 or first == 0x82:  # a whole text or binary message: nearly every frame
                messages.append(data[pos + head : stop])
            elif first == 0xC1:  # a whole compressed text message (permessage-deflate, no context takeover)
                messages.append(INFLATER.inflate(data[pos + head : stop]))
            elif first & 0x0F <= 2:  # a fragment
                self._data_frame(first & 0x0F, bool(first & 0x80), data[pos + head : stop], messages)
            else:  # ping, pong, close (or an opcode websockets rejects): one whole frame, at a frame boundary
                messages += self._through_websockets(data[pos:stop])
            pos = stop
        if pos < end:
            self._pending, self._pending_len = [data[pos:]], end - pos
            self._need = max(self._need, 2)
        return messages

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
        self.inflating = bool(self.protocol.extensions)
        self.opened.set_result(None)
        self.listener.ws_open()

    def _closing(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self.opened.done() and self.opened.exception() is None:
            self.listener.ws_closed(reason)


async def connect(
    host: str,
    port: int,
    path: str,
    listener: Listener,
    timeout: float = 10.0,
    source: str | None = None,
    compression: bool = False,
) -> WsClient:
    """Open a connection to ``ws://host:port/path`` and wait for the handshake; raises on failure.
    ``source``: the local address to connect from (any port); ``compression``: offer permessage-deflate."""
    loop = asyncio.get_running_loop()
    url = f"ws://{host}:{port}{path}"
    _transport, client = await within(
        loop.create_connection(
            lambda: WsClient(url, listener, compression), host, port, local_addr=(source, 0) if source else None
        ),
        timeout,
    )
    try:
        await within(asyncio.shield(client.opened), timeout)
    except BaseException:
        if client.transport is not None:
            client.transport.abort()
        raise
    return client
