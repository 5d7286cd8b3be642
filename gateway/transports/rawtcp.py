"""Raw TCP broadcaster (docs/design/byte-ring.md): one sender's byte stream, unchanged, to up to 16 receivers.

The asyncio adapter around ``core.byte_ring.ByteRing`` (which owns every position, the lag policy and
the sender's flow control). Works on the default event loop and on uvloop.

Data path, with no per-receiver copy made here:

* the sender is an ``asyncio.BufferedProtocol``: ``get_buffer`` lends the ring's own free memory
  (``ByteRing.reserve``), so the kernel's recv writes straight into the ring, like the provided
  buffers of docs/design/byte-ring.md §3; in drain mode that memory is scratch and the bytes are counted as
  dropped;
* each receiver is handed ``memoryview`` slices of the ring (``ByteRing.readable``) with
  ``transport.write``. The default loop copies what the kernel did not take into the transport's
  buffer; uvloop keeps a reference to our memoryview instead, so bytes a transport still buffers are
  reported to the ring as ``in_flight`` and stay pinned (never overwritten) until it has drained them;
* a receiver's write buffer limit is 0: ``pause_writing`` as soon as the kernel refuses a byte,
  ``resume_writing`` when the transport holds nothing more. A write-blocked receiver is handed
  nothing; its lag grows in the ring, where the lag policy (docs/design/byte-ring.md §4) sees it.

Sender flow control (docs/design/byte-ring.md §5): ``transport.pause_reading()`` at the pause watermark,
``resume_reading()`` at the resume watermark. Lagging receivers are checked after writes and on a
timer (``check_interval``, 100 ms), because a stalled receiver must be kicked even when the sender is
paused and nothing else happens.

Shared secret: with a ``token``, the sender and every receiver first send the line ``TOKEN\\n`` within
``handshake_timeout`` seconds. Until then a sender does not hold the sender slot and its bytes go to a
small buffer of its own, not the ring; a receiver is not registered (no slot, no data). A wrong or missing
line closes the connection. A sender that sends nothing for ``sender_idle_timeout`` seconds (not counting
time paused by flow control) is disconnected, so an idle one cannot keep the only slot.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from core.byte_ring import ByteRing, ByteRingConfig, FlowAction, TooManyReceivers

from ..edge.ratelog import BadInputLog

__all__ = ["RawBroadcastServer"]

_log = logging.getLogger(__name__)

#: Seconds between lag checks when nothing else happens. The default kick_grace_ms is 500 ms
#: (docs/design/byte-ring.md §7); 100 ms keeps a kick within a fifth of the grace window for the cost of a
#: loop over <= 16 receivers.
DEFAULT_CHECK_INTERVAL_S = 0.1

#: Most bytes of a token line, its newline included: a peer without the token cannot make us buffer more.
TOKEN_LINE_MAX = 1024


class _TokenLine:
    """The ``TOKEN\\n`` line a connection sends first when a token is set, read into its own small buffer."""

    def __init__(self, timer: asyncio.TimerHandle) -> None:
        self.buf = bytearray(TOKEN_LINE_MAX)
        self.size = 0
        self.timer = timer

    def room(self) -> memoryview:
        return memoryview(self.buf)[self.size :]


class _ReceiverProtocol(asyncio.Protocol):
    """One receiver connection. Receivers have nothing to say: what they send is discarded."""

    def __init__(self, server: RawBroadcastServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.rid: int | None = None
        self.peer: Any = None
        #: Set by pause_writing: the transport holds bytes the kernel refused; hand it nothing more.
        self.write_paused = False
        self.handshake: _TokenLine | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream protocol is given a Transport
        self.server._receiver_made(self)

    def data_received(self, data: bytes) -> None:
        if self.handshake is not None:
            self.server._receiver_handshake(self, data)
        else:
            self.server._receiver_bytes_discarded += len(data)

    def eof_received(self) -> bool:
        # A receiver's EOF ends it. Staying half-open would keep a departed receiver's slot (one of
        # max_receivers) until the next write fails, which never comes while the sender is idle.
        # The transport closes gracefully; its bytes stay pinned in the ring until connection_lost.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.server._schedule_pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._handshake_over(self)
        self.server._receiver_lost(self, exc)


class _SenderProtocol(asyncio.BufferedProtocol):
    """The sender connection: the kernel writes into memory lent by the ring."""

    def __init__(self, server: RawBroadcastServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.accepted = False
        self.handshake: _TokenLine | None = None
        self._scratch: memoryview | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream protocol is given a Transport
        self.server._sender_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.accepted:
            return self.server._sender_get_buffer()
        if self.handshake is not None:
            return self.handshake.room()  # never empty: a full buffer without a newline is refused
        # A refused sender is closed already; should a read still come, it is dropped.
        if self._scratch is None:
            self._scratch = memoryview(bytearray(4096))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.accepted:
            self.server._sender_data(nbytes)
        elif self.handshake is not None:
            self.server._sender_handshake(self, nbytes)

    def eof_received(self) -> bool:
        return False  # close: the sender is gone, the receivers keep what is in the ring

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._handshake_over(self)
        self.server._sender_lost(self, exc)


class RawBroadcastServer:
    """The broadcaster of docs/design/byte-ring.md: a sender port (one sender at a time) and a receiver port.

    ``await start(host, sender_port, receiver_port)`` binds both (0 picks a free port; the real ones
    are then in ``sender_port`` and ``receiver_port``), ``await stop()`` closes everything.
    ``stats()`` and ``receivers()`` are snapshots for monitoring. ``clock`` returns monotonic
    nanoseconds (injectable for tests); everything runs on the loop that called ``start``.
    ``token`` (empty: none), ``handshake_timeout`` and ``sender_idle_timeout`` (0: none) are in seconds,
    see the module docstring; refused handshakes are reported to ``bad_input(source, message, *args)``
    (a ``BadInputLog``: rate-limited, counted), by default a limiter of its own.
    """

    def __init__(
        self,
        config: ByteRingConfig | None = None,
        logger: logging.Logger | None = None,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        check_interval: float = DEFAULT_CHECK_INTERVAL_S,
        token: str = "",
        handshake_timeout: float = 10.0,
        sender_idle_timeout: float = 0.0,
        bad_input: Callable[..., object] | None = None,
    ) -> None:
        if check_interval <= 0:
            raise ValueError(f"check_interval must be > 0, got {check_interval!r}")
        self.config = config if config is not None else ByteRingConfig()
        self._log = logger if logger is not None else _log
        self._clock = clock
        self._check_interval = check_interval
        self._token = token.encode()
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = sender_idle_timeout
        self._bad_input = bad_input if bad_input is not None else BadInputLog(5.0)
        self._ring = ByteRing(self.config)
        self._receivers: dict[int, _ReceiverProtocol] = {}
        #: connections still to send their token line (closed by stop, like the others)
        self._handshaking: set[_SenderProtocol | _ReceiverProtocol] = set()
        self._ids = itertools.count(1)
        self._sender: _SenderProtocol | None = None
        # Sender bytes read while the ring had no free byte at all, kept in order until it has.
        # docs/design/byte-ring.md §5 pauses reading at free < recv_chunk_bytes, so this only happens when a
        # sender connects to a full ring: uvloop starts reading after connection_made whatever it asked.
        # Reading is paused again right after that read, so one read's worth waits here.
        self._spill = memoryview(bytearray(self.config.recv_chunk_bytes))
        self._spilled = False
        self._pending = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._timer: asyncio.TimerHandle | None = None
        # One idle timer for the sender slot, re-armed lazily from the last data time: no per-read churn.
        self._idle_timer: asyncio.TimerHandle | None = None
        self._sender_last_data = 0  # clock() of the sender's last read (or of reading resuming)
        self._pump_handle: asyncio.Handle | None = None
        self._running = False
        self.sender_port: int | None = None
        self.receiver_port: int | None = None
        self.host: str | None = None
        # Adapter counters, beside the ring's metrics (docs/design/byte-ring.md §8).
        self._sender_connections = 0
        self._senders_refused = 0
        self._receivers_refused = 0
        self._receiver_bytes_discarded = 0
        self._handshakes_refused = 0
        self._senders_idle = 0

    # ------------------------------------------------------------- lifecycle
    async def start(self, host: str, sender_port: int, receiver_port: int) -> None:
        """Listen on ``host``: senders on ``sender_port``, receivers on ``receiver_port``.

        Give ``host`` as one address when a port is 0: a name resolving to several addresses would
        get a different ephemeral port per address, and only the first is reported."""
        if self._running:
            raise RuntimeError("RawBroadcastServer is already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        sender_srv = await loop.create_server(lambda: _SenderProtocol(self), host, sender_port)
        try:
            receiver_srv = await loop.create_server(lambda: _ReceiverProtocol(self), host, receiver_port)
        except BaseException:
            sender_srv.close()
            raise
        self._servers = [sender_srv, receiver_srv]
        self.host = host
        self.sender_port = sender_srv.sockets[0].getsockname()[1]
        self.receiver_port = receiver_srv.sockets[0].getsockname()[1]
        self._running = True
        self._timer = loop.call_later(self._check_interval, self._tick)
        self._log.info(
            "rawtcp broadcaster listening: senders on %s:%d, receivers on %s:%d (ring %d bytes)",
            host,
            self.sender_port,
            host,
            self.receiver_port,
            self.config.capacity_bytes,
        )

    async def stop(self) -> None:
        """Stop listening and drop every connection (what transports still buffer is discarded)."""
        if not self._running:
            return
        self._running = False
        for handle in (self._timer, self._pump_handle, self._idle_timer):
            if handle is not None:
                handle.cancel()
        self._timer = self._pump_handle = self._idle_timer = None
        for srv in self._servers:
            srv.close()
        if self._sender is not None and self._sender.transport is not None:
            self._sender.transport.abort()
        for rid, rc in list(self._receivers.items()):
            self._drop_receiver(rid)
            if rc.transport is not None:
                rc.transport.abort()
        for proto in list(self._handshaking):
            self._handshake_over(proto)
            if proto.transport is not None:
                proto.transport.abort()
        for srv in self._servers:
            await srv.wait_closed()
        self._servers = []
        await asyncio.sleep(0)  # let connection_lost callbacks run
        self._log.info("rawtcp broadcaster stopped")

    # ----------------------------------------------------------- monitoring
    def stats(self) -> dict[str, Any]:
        """The ring's metrics (docs/design/byte-ring.md §8) plus the adapter's view of the connections."""
        out: dict[str, Any] = self._ring.metrics(self._clock()).as_dict()
        sender = self._sender
        out.update(
            sender_connected=sender is not None,
            paused=self._ring.sender_paused,
            sender_reading=bool(sender is not None and sender.transport is not None and sender.transport.is_reading()),
            sender_connections=self._sender_connections,
            senders_refused=self._senders_refused,
            receivers_refused=self._receivers_refused,
            receiver_bytes_discarded=self._receiver_bytes_discarded,
            handshakes_refused=self._handshakes_refused,
            senders_idle=self._senders_idle,
            pending_sender_bytes=len(self._pending),
        )
        return out

    def receivers(self) -> list[dict[str, Any]]:
        """One dict per connected receiver: id, peer, lag, state, bytes_sent, in_flight, write_paused."""
        now = self._clock()
        out = []
        for rid, rc in self._receivers.items():
            info = self._ring.receiver_info(rid, now)
            out.append(
                {
                    "id": rid,
                    "peer": rc.peer,
                    "lag": info.lag,
                    "state": info.state.value,
                    "bytes_sent": info.bytes_sent,
                    "in_flight": info.in_flight,
                    "write_paused": rc.write_paused,
                }
            )
        return out

    # --------------------------------------------------------------- sender
    def _sender_made(self, proto: _SenderProtocol) -> None:
        assert proto.transport is not None
        proto.peer = proto.transport.get_extra_info("peername")
        if self._token and self._running:
            self._handshake_start(proto, "sender")
        else:
            self._sender_accept(proto)

    def _sender_handshake(self, proto: _SenderProtocol, nbytes: int) -> None:
        rest = self._token_line(proto, nbytes, "sender")
        if rest is not None:
            self._sender_accept(proto, rest)

    def _sender_accept(self, proto: _SenderProtocol, rest: bytes = b"") -> None:
        """Give `proto` the sender slot (with `rest`, data read along with its token line) or refuse it."""
        transport = proto.transport
        assert transport is not None
        if not self._running or self._sender is not None:
            # docs/design/byte-ring.md §2: one sender at a time; another one is refused, not queued.
            self._senders_refused += 1
            self._log.warning(
                "rawtcp: refused sender %s: %s",
                proto.peer,
                "a sender is already connected" if self._running else "server stopping",
            )
            transport.close()
            return
        proto.accepted = True
        self._sender = proto
        self._sender_connections += 1
        self._log.info("rawtcp: sender connected from %s", proto.peer)
        now = self._clock()
        self._sender_last_data = now
        if self._idle_timeout > 0 and self._idle_timer is None:
            assert self._loop is not None
            self._idle_timer = self._loop.call_later(self._idle_timeout, self._sender_idle_check)
        if rest:
            # In the order read, before anything the ring lends for later reads (see _sender_get_buffer).
            self._pending += rest
            self._flush_pending()
            self._sync_flow(now)
        self._sync_sender_reading()
        # uvloop starts reading after connection_made whatever it asked: apply the state again.
        assert self._loop is not None
        self._loop.call_soon(self._sync_sender_reading)

    def _sender_get_buffer(self) -> memoryview:
        if not self._pending:
            try:
                view = self._ring.reserve()
            except BufferError:
                pass
            else:
                self._spilled = False
                return view
        # The ring is full, or older bytes wait in _pending: keep the order, spill (see __init__).
        self._spilled = True
        return self._spill

    def _sender_data(self, nbytes: int) -> None:
        if self._spilled:
            self._spilled = False
            self._pending += bytes(self._spill[:nbytes])
        else:
            self._ring.commit(nbytes)
        now = self._clock()
        self._sender_last_data = now
        # Pause at once (docs/design/byte-ring.md §5.3): the next read must find recv_chunk_bytes free.
        self._sync_flow(now)
        self._schedule_pump()

    def _sender_lost(self, proto: _SenderProtocol, exc: Exception | None) -> None:
        if self._sender is not proto:
            return
        self._sender = None
        # docs/design/byte-ring.md §2: no role change; receivers keep what is in the ring and a new sender
        # may come.
        self._log.info("rawtcp: sender %s disconnected (%s)", proto.peer, exc or "closed")

    def _sender_idle_check(self) -> None:
        self._idle_timer = None
        sender = self._sender
        if sender is None or not self._running:
            return  # the next sender arms the timer again
        assert sender.transport is not None and self._loop is not None
        now = self._clock()
        if not sender.transport.is_reading():
            self._sender_last_data = now  # paused by flow control: not the sender's silence
        idle_s = (now - self._sender_last_data) / 1e9
        if idle_s < self._idle_timeout:
            self._idle_timer = self._loop.call_later(self._idle_timeout - idle_s, self._sender_idle_check)
            return
        self._senders_idle += 1
        self._log.info("rawtcp: sender %s disconnected: nothing sent for %.1f s", sender.peer, idle_s)
        sender.transport.close()  # connection_lost frees the slot

    def _sync_flow(self, now: int) -> None:
        action = self._ring.update_flow(now)
        if action is FlowAction.PAUSE:
            self._log.debug("rawtcp: ring at the pause watermark, sender reading paused")
        elif action is FlowAction.RESUME:
            self._log.debug("rawtcp: ring at the resume watermark, sender reading resumed")
        self._sync_sender_reading()

    def _sync_sender_reading(self) -> None:
        sender = self._sender
        if sender is None or sender.transport is None or sender.transport.is_closing():
            return
        transport = sender.transport
        want = self._running and not self._ring.sender_paused and not self._pending
        if want and not transport.is_reading():
            transport.resume_reading()
            self._sender_last_data = self._clock()  # it could not send while paused: its idle time starts now
        elif not want and transport.is_reading():
            transport.pause_reading()

    def _flush_pending(self) -> None:
        if self._pending:
            n = self._ring.write(self._pending)
            self._pending = self._pending[n:]
            if n:
                self._schedule_pump()

    # ------------------------------------------------------------ receivers
    def _receiver_made(self, rc: _ReceiverProtocol) -> None:
        transport = rc.transport
        assert transport is not None
        rc.peer = transport.get_extra_info("peername")
        if not self._running:
            transport.close()
        elif self._token:
            self._handshake_start(rc, "receiver")
        else:
            self._receiver_accept(rc)

    def _receiver_handshake(self, rc: _ReceiverProtocol, data: bytes) -> None:
        assert rc.handshake is not None
        room = rc.handshake.room()
        n = min(len(data), len(room))
        room[:n] = data[:n]
        rest = self._token_line(rc, n, "receiver")
        if rest is not None:
            self._receiver_bytes_discarded += len(rest) + len(data) - n  # a receiver's data is discarded
            self._receiver_accept(rc)

    def _receiver_accept(self, rc: _ReceiverProtocol) -> None:
        transport = rc.transport
        assert transport is not None
        rid = next(self._ids)
        try:
            self._ring.add_receiver(rid, self._clock())
        except TooManyReceivers:
            self._receivers_refused += 1
            self._log.warning(
                "rawtcp: refused receiver %s: %d receivers already (docs/design/byte-ring.md §1)",
                rc.peer,
                self.config.max_receivers,
            )
            transport.close()
            return
        rc.rid = rid
        self._receivers[rid] = rc
        # High water 0: pause_writing once the kernel refuses a byte, resume_writing when the
        # transport holds nothing; see the module docstring.
        transport.set_write_buffer_limits(high=0)
        self._log.info("rawtcp: receiver %d connected from %s", rid, rc.peer)

    def _drop_receiver(self, rid: int) -> None:
        self._receivers.pop(rid, None)
        if rid in self._ring:
            self._ring.remove_receiver(rid)

    def _receiver_lost(self, rc: _ReceiverProtocol, exc: Exception | None) -> None:
        rid = rc.rid
        if rid is None or self._receivers.get(rid) is not rc:
            return  # refused, kicked or stopped: already forgotten
        self._drop_receiver(rid)
        self._log.info("rawtcp: receiver %d (%s) disconnected (%s)", rid, rc.peer, exc or "closed")
        if self._running:
            self._settle(self._clock())

    # ------------------------------------------------------------- handshake
    def _handshake_start(self, proto: _SenderProtocol | _ReceiverProtocol, role: str) -> None:
        assert self._loop is not None
        timer = self._loop.call_later(
            self._handshake_timeout,
            self._handshake_refuse,
            proto,
            role,
            f"no token line within {self._handshake_timeout:g} s",
        )
        proto.handshake = _TokenLine(timer)
        self._handshaking.add(proto)

    def _token_line(self, proto: _SenderProtocol | _ReceiverProtocol, nbytes: int, role: str) -> bytes | None:
        """Take `nbytes` more read into `proto.handshake`. Once the token line is complete and right: the
        bytes read after it. None while it is incomplete, or when it was wrong (the connection is closing)."""
        line = proto.handshake
        assert line is not None
        start = line.size
        line.size += nbytes
        end = line.buf.find(b"\n", start, line.size)
        if end < 0:
            if line.size == TOKEN_LINE_MAX:
                self._handshake_refuse(proto, role, f"no newline in the first {TOKEN_LINE_MAX} bytes")
            return None
        self._handshake_over(proto)
        # A \r before the newline is tolerated (telnet, nc -C).
        if not hmac.compare_digest(bytes(line.buf[:end]).removesuffix(b"\r"), self._token):
            self._handshake_refuse(proto, role, "wrong token")
            return None
        return bytes(line.buf[end + 1 : line.size])

    def _handshake_over(self, proto: _SenderProtocol | _ReceiverProtocol) -> None:
        if proto.handshake is not None:
            proto.handshake.timer.cancel()
            proto.handshake = None
            self._handshaking.discard(proto)

    def _handshake_refuse(self, proto: _SenderProtocol | _ReceiverProtocol, role: str, reason: str) -> None:
        self._handshake_over(proto)
        self._handshakes_refused += 1
        self._bad_input("rawtcp", "%s %s refused: %s", role, proto.peer, reason)
        assert proto.transport is not None
        proto.transport.close()

    # ------------------------------------------------------------------ pump
    def _schedule_pump(self) -> None:
        # Coalesce: every read of one loop iteration goes out in one write per receiver.
        if self._pump_handle is None and self._running:
            assert self._loop is not None
            self._pump_handle = self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Hand every receiver that can take more its readable bytes; report what transports still
        hold; then apply the lag policy and the sender's flow control."""
        self._pump_handle = None
        if not self._running:
            return
        now = self._clock()
        ring = self._ring
        for rid, rc in list(self._receivers.items()):
            transport = rc.transport
            assert transport is not None
            if transport.is_closing():
                continue  # connection_lost will drop it; its bytes stay pinned until then
            n = 0
            if not rc.write_paused:
                for view in ring.readable(rid):
                    transport.write(view)
                    n += len(view)
                if transport.is_closing():
                    continue  # the write failed: do not release what the transport may hold
            ring.advance(rid, n, now, in_flight=transport.get_write_buffer_size())
        self._settle(now)

    def _settle(self, now: int) -> None:
        for rid in self._ring.check_lagging(now):
            rc = self._receivers.pop(rid, None)  # type: ignore[call-overload]  # the ring's ids are ours: ints
            if rc is None or rc.transport is None:
                continue
            self._log.warning(
                "rawtcp: receiver %d (%s) disconnected: lag over %d bytes with no progress for %d ms "
                "(docs/design/byte-ring.md §4)",
                rid,
                rc.peer,
                self.config.hard_lag_bytes,
                self.config.kick_grace_ms,
            )
            # abort, not close: the ring no longer protects the bytes its transport still references.
            rc.transport.abort()
        self._flush_pending()
        self._sync_flow(now)

    def _tick(self) -> None:
        self._timer = None
        if not self._running:
            return
        try:
            self._pump()
        finally:
            assert self._loop is not None
            self._timer = self._loop.call_later(self._check_interval, self._tick)
