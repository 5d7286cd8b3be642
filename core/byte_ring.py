"""Sans-I/O byte ring for the single-sender, many-receiver raw TCP broadcaster (docs/design/byte-ring.md).

One sender's TCP stream is copied once into a fixed ring; every receiver reads the same bytes out of it
at its own position. This module owns every position, every lag decision and the sender's flow control;
it does no I/O and never reads a clock: time comes in as ``now_ns`` (any monotonic nanosecond count, the
adapter passes ``time.monotonic_ns()``).

Positions are monotonic byte counts (docs/design/byte-ring.md §3); the byte at position ``p`` lives
at ``p % capacity``::

    write_pos            bytes the sender stored so far (never moves in drain mode, see below)
    send_pos(r)          bytes handed to receiver r's socket or transport
    read_pos(r)          bytes of r the transport no longer references: they may be overwritten
    lag(r)             = write_pos - read_pos(r)
    used_bytes         = write_pos - min(read_pos(r))         (0 without receivers)
    free_bytes         = capacity - used_bytes

``send_pos`` and ``read_pos`` differ only while a transport still holds a reference to ring memory
(uvloop's ``transport.write`` keeps a ``memoryview`` instead of copying, like an io_uring ``SEND_ZC``
whose buffer is pinned until its notification): those bytes must not be overwritten, so they still
count in the lag and in ``used_bytes``. A caller whose send copies (``socket.send``) leaves
``in_flight`` at 0 and the two positions are always equal.

Calling contract, sender side (one sender at a time)::

    view = ring.reserve()      # zero-copy: recv_into(view)            or  ring.write(data)
    ring.commit(n)             # n bytes of view were filled
    ring.update_flow(now_ns)   # -> FlowAction.PAUSE: stop reading the sender; RESUME: read again

Receiver side, for each receiver whose socket can take more::

    views = ring.readable(rid)                     # one or two memoryviews (two at the wrap)
    ...send them...
    ring.advance(rid, n, now_ns, in_flight=k)       # n handed over, k of them still referenced
    ring.check_lagging(now_ns)                      # -> receivers removed for lag: drop them now
    ring.update_flow(now_ns)

``update_flow`` must be called after every call that changes ``used_bytes`` (``commit``, ``write``,
``advance``, ``remove_receiver``, ``check_lagging``): the sender is then never read while the ring has
less than ``recv_chunk_bytes`` free, so ``reserve`` always has room when the sender is not paused.

Drain mode (docs/design/byte-ring.md §6): with no receiver, ``commit``/``write`` do not store anything; the
bytes are counted in ``bytes_dropped_no_receiver`` and ``write_pos`` does not move (a receiver only ever
gets bytes written after it joined, so dropped bytes need no position). ``reserve`` then lends the ring's
memory itself as a scratch buffer: all of it is free.
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Hashable
from dataclasses import asdict, dataclass

__all__ = [
    "ByteRing",
    "ByteRingConfig",
    "FlowAction",
    "ReceiverInfo",
    "ReceiverState",
    "RingMetrics",
    "TooManyReceivers",
    "UnknownReceiver",
]

_MIB = 1024 * 1024
_KIB = 1024


class TooManyReceivers(RuntimeError):
    """``add_receiver`` beyond ``max_receivers``: the caller must refuse (close) that connection."""


class UnknownReceiver(KeyError):
    """A receiver id that was never added or was already removed (our own misuse)."""


class ReceiverState(enum.Enum):
    """Lag class of one receiver, docs/design/byte-ring.md §4."""

    #: lag <= soft_lag_bytes.
    HEALTHY = "healthy"
    #: soft_lag_bytes < lag <= hard_lag_bytes: marked slow, nothing is done yet.
    SLOW = "slow"
    #: lag > hard_lag_bytes but it progressed within kick_grace_ms: a disconnection candidate.
    LAGGING = "lagging"
    #: lag > hard_lag_bytes and no progress for more than kick_grace_ms: to be disconnected.
    KICK = "kick"


class FlowAction(str, enum.Enum):
    """A transition of the sender's flow control returned by ``ByteRing.update_flow``."""

    #: Stop reading the sender (docs/design/byte-ring.md §5: no more recv is armed).
    PAUSE = "pause"
    #: Read the sender again.
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class ByteRingConfig:
    """Limits of one ring. Defaults are docs/design/byte-ring.md §7; every one can be overridden."""

    #: docs/design/byte-ring.md §7: 40 Gbit/s is about 5 GB/s; absorbing ~50 ms of jitter needs ~256 MB.
    capacity_bytes: int = 256 * _MIB
    #: docs/design/byte-ring.md §4: beyond this lag a receiver is marked slow.
    soft_lag_bytes: int = 32 * _MIB
    #: docs/design/byte-ring.md §4: beyond this lag a receiver becomes a disconnection candidate.
    hard_lag_bytes: int = 96 * _MIB
    #: docs/design/byte-ring.md §4: the no-progress window allowed once past hard_lag_bytes.
    kick_grace_ms: int = 500
    #: docs/design/byte-ring.md §5: high watermark (percent of capacity) that pauses the sender's recv.
    pause_watermark_pct: int = 80
    #: docs/design/byte-ring.md §5: low watermark that resumes it; the gap is the hysteresis.
    resume_watermark_pct: int = 55
    #: docs/design/byte-ring.md §3: bytes per sender recv (a provided buffer); ``reserve`` lends at most
    #: this.
    recv_chunk_bytes: int = 64 * _KIB
    #: docs/design/byte-ring.md §1: at most 16 receivers at a time.
    max_receivers: int = 16

    def __post_init__(self) -> None:
        for name in (
            "capacity_bytes",
            "soft_lag_bytes",
            "hard_lag_bytes",
            "recv_chunk_bytes",
            "max_receivers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.kick_grace_ms, int) or self.kick_grace_ms < 0:
            raise ValueError(f"kick_grace_ms must be an int >= 0, got {self.kick_grace_ms!r}")
        if not 0 < self.resume_watermark_pct < self.pause_watermark_pct <= 100:
            raise ValueError(
                "watermarks must satisfy 0 < resume_watermark_pct < pause_watermark_pct <= 100, got "
                f"resume={self.resume_watermark_pct!r} pause={self.pause_watermark_pct!r}"
            )
        if self.hard_lag_bytes < self.soft_lag_bytes:
            raise ValueError(f"hard_lag_bytes ({self.hard_lag_bytes}) must be >= soft_lag_bytes ({self.soft_lag_bytes})")
        # Resuming needs 2 * recv_chunk_bytes free (docs/design/byte-ring.md §5): an emptied ring must
        # allow it.
        if self.capacity_bytes < 2 * self.recv_chunk_bytes:
            raise ValueError(f"capacity_bytes ({self.capacity_bytes}) must be >= 2 * recv_chunk_bytes ({self.recv_chunk_bytes})")
        # The slowest receiver bounds what is stored: the sender is paused once used_bytes reaches the
        # pause watermark (or free < recv_chunk_bytes). If a stalled receiver could never get past
        # hard_lag_bytes before that, it would never be kicked and would hold every other receiver
        # at a paused sender forever (docs/design/byte-ring.md §4.4: shed slow receivers so they don't drag
        # the rest).
        if self.hard_lag_bytes >= self.lag_bound_bytes:
            raise ValueError(
                f"hard_lag_bytes ({self.hard_lag_bytes}) must be below the fill at which the sender is "
                f"paused ({self.lag_bound_bytes} bytes): otherwise a stalled receiver is never kicked "
                "and stalls every receiver"
            )

    @property
    def pause_threshold_bytes(self) -> int:
        """``capacity * pause_watermark_pct / 100`` in integer arithmetic (docs/design/byte-ring.md §5)."""
        return self.capacity_bytes * self.pause_watermark_pct // 100

    @property
    def resume_threshold_bytes(self) -> int:
        """``capacity * resume_watermark_pct / 100`` in integer arithmetic (docs/design/byte-ring.md §5)."""
        return self.capacity_bytes * self.resume_watermark_pct // 100

    @property
    def lag_bound_bytes(self) -> int:
        """The least ``used_bytes`` at which the sender is certainly paused: a stalled receiver's lag
        reaches at least this much (pause when used >= pause threshold or free < recv_chunk_bytes)."""
        return min(self.pause_threshold_bytes, self.capacity_bytes - self.recv_chunk_bytes + 1)


@dataclass(frozen=True, slots=True)
class ReceiverInfo:
    """A snapshot of one receiver, for stats pages."""

    rid: Hashable
    lag: int
    in_flight: int
    state: ReceiverState
    bytes_sent: int


@dataclass(frozen=True, slots=True)
class RingMetrics:
    """Metrics of docs/design/byte-ring.md §8 (the io_uring-only sqe/cqe counters have no meaning here).

    Counters: ``bytes_received`` every byte taken from the sender, stored or dropped;
    ``bytes_sent`` bytes released by receivers (out of our hands: in the kernel), summed;
    ``bytes_dropped_no_receiver`` bytes taken in drain mode; ``total_connections`` receivers ever
    added; ``disconnections_lag`` receivers removed by ``check_lagging``; ``sender_recv_pause_count``
    PAUSE transitions; ``sender_recv_pause_ns`` time spent paused, the current pause included.
    Gauges: ``active_receivers``, ``ring_buffer_used`` (used_bytes), ``max_receiver_lag``.
    """

    bytes_received: int
    bytes_sent: int
    bytes_dropped_no_receiver: int
    active_receivers: int
    total_connections: int
    disconnections_lag: int
    ring_buffer_used: int
    max_receiver_lag: int
    sender_recv_pause_count: int
    sender_recv_pause_ns: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Receiver:
    __slots__ = ("read_pos", "send_pos", "last_progress_ns", "over_hard_since_ns", "bytes_sent")

    def __init__(self, pos: int, now_ns: int) -> None:
        self.read_pos = pos
        self.send_pos = pos
        self.last_progress_ns = now_ns
        #: When check_lagging first saw lag > hard_lag_bytes; None while at or under it.
        self.over_hard_since_ns: int | None = None
        self.bytes_sent = 0


class ByteRing:
    """A fixed ring of ``capacity_bytes`` shared by every receiver; see the module docstring for the
    calling contract. Not thread-safe: one event loop drives it."""

    def __init__(self, config: ByteRingConfig | None = None) -> None:
        self._cfg = config if config is not None else ByteRingConfig()
        cap = self._cfg.capacity_bytes
        # Allocated once; every view handed out is a slice of this one memoryview. Anonymous memory, not a
        # bytearray: its pages are zero until written, so an unused ring costs no RSS (a bytearray of the
        # default 256 MiB was resident from start-up); a ring that has wrapped once holds all of it.
        self._buf = mmap.mmap(-1, cap)
        self._view = memoryview(self._buf)
        self._cap = cap
        self._write_pos = 0
        self._receivers: dict[Hashable, _Receiver] = {}
        self._reserved = 0
        # Flow control, docs/design/byte-ring.md §5.
        self._paused = False
        self._paused_since_ns = 0
        # Metrics, docs/design/byte-ring.md §8.
        self._bytes_received = 0
        self._bytes_sent = 0
        self._bytes_dropped = 0
        self._total_connections = 0
        self._disconnections_lag = 0
        self._pause_count = 0
        self._pause_ns = 0

    # ---------------------------------------------------------------- state
    @property
    def config(self) -> ByteRingConfig:
        return self._cfg

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def write_pos(self) -> int:
        return self._write_pos

    @property
    def drain_mode(self) -> bool:
        """True while there is no receiver: sender bytes are dropped (docs/design/byte-ring.md §6)."""
        return not self._receivers

    @property
    def used_bytes(self) -> int:
        """``write_pos - min(read_pos)``: bytes some receiver still needs (docs/design/byte-ring.md §3)."""
        if not self._receivers:
            return 0
        return self._write_pos - min(r.read_pos for r in self._receivers.values())

    @property
    def free_bytes(self) -> int:
        return self._cap - self.used_bytes

    @property
    def sender_paused(self) -> bool:
        """Whether the sender must not be read (set and cleared by ``update_flow`` only)."""
        return self._paused

    @property
    def receiver_count(self) -> int:
        return len(self._receivers)

    def receiver_ids(self) -> list[Hashable]:
        return list(self._receivers)

    def __contains__(self, rid: object) -> bool:
        return rid in self._receivers

    def _get(self, rid: Hashable) -> _Receiver:
        try:
            return self._receivers[rid]
        except KeyError:
            raise UnknownReceiver(rid) from None

    # ------------------------------------------------------------ receivers
    def add_receiver(self, rid: Hashable, now_ns: int) -> int:
        """Register receiver ``rid``; it gets every byte written from now on, none before
        (docs/design/byte-ring.md §1). Returns its start position (the current ``write_pos``).

        Raises ``TooManyReceivers`` at ``max_receivers`` (the caller closes that connection) and
        ``ValueError`` for an id already present.
        """
        if rid in self._receivers:
            raise ValueError(f"receiver {rid!r} is already registered")
        if len(self._receivers) >= self._cfg.max_receivers:
            raise TooManyReceivers(f"at most {self._cfg.max_receivers} receivers (docs/design/byte-ring.md §1); refused {rid!r}")
        self._receivers[rid] = _Receiver(self._write_pos, now_ns)
        self._total_connections += 1
        return self._write_pos

    def remove_receiver(self, rid: Hashable) -> None:
        """Forget ``rid``: its unread bytes may be overwritten by the next write, so the caller must
        already have dropped whatever its transport still references (``transport.abort()``).
        Call ``update_flow`` afterwards: the ring may have emptied."""
        self._get(rid)
        del self._receivers[rid]

    def lag(self, rid: Hashable) -> int:
        """``write_pos - read_pos``, bytes still in flight included."""
        return self._write_pos - self._get(rid).read_pos

    def readable(self, rid: Hashable) -> list[memoryview]:
        """Zero-copy views over ``[send_pos, write_pos)`` of ``rid``: the bytes not yet handed to its
        socket, in order; empty, one view, or two when the range wraps. The views stay valid until
        the bytes are released by ``advance`` (then they may be overwritten): send them, do not keep
        them."""
        r = self._get(rid)
        start = r.send_pos
        n = self._write_pos - start
        if n == 0:
            return []
        cap = self._cap
        off = start % cap
        end = off + n
        if end <= cap:
            return [self._view[off:end]]
        return [self._view[off:cap], self._view[: end - cap]]

    def advance(self, rid: Hashable, nbytes: int, now_ns: int, *, in_flight: int = 0) -> None:
        """Record that ``nbytes`` more from the front of ``readable(rid)`` were handed to the socket,
        and that the transport still references the last ``in_flight`` of every byte handed so far
        (``transport.get_write_buffer_size()``; 0 for a copying ``socket.send``). Call it with
        ``nbytes=0`` to report a transport that drained. Bytes no longer in flight are released; a
        release is progress for the lag policy (docs/design/byte-ring.md §4).

        Raises ``ValueError`` when ``nbytes`` exceeds what was readable or the released position
        would move backwards (the caller's accounting is wrong).
        """
        r = self._get(rid)
        if nbytes < 0 or r.send_pos + nbytes > self._write_pos:
            raise ValueError(f"advance({rid!r}, {nbytes}): only {self._write_pos - r.send_pos} bytes were readable")
        send_pos = r.send_pos + nbytes
        read_pos = send_pos - in_flight
        if in_flight < 0 or read_pos < r.read_pos:
            raise ValueError(
                f"advance({rid!r}): in_flight={in_flight} would un-release bytes "
                f"(released up to {r.read_pos}, handed up to {send_pos})"
            )
        r.send_pos = send_pos
        released = read_pos - r.read_pos
        if released:
            r.read_pos = read_pos
            r.bytes_sent += released
            self._bytes_sent += released
            r.last_progress_ns = now_ns

    # ----------------------------------------------------------------- lag
    def _classify(self, r: _Receiver, now_ns: int, over_hard_since_ns: int | None) -> ReceiverState:
        lag = self._write_pos - r.read_pos
        cfg = self._cfg
        if lag <= cfg.soft_lag_bytes:
            return ReceiverState.HEALTHY
        if lag <= cfg.hard_lag_bytes:
            return ReceiverState.SLOW
        # docs/design/byte-ring.md §4.2: kick_grace_ms is the no-progress window allowed *after* passing the
        # hard threshold, so the window starts at the later of the last progress and the moment the
        # receiver was seen past it: a receiver that was idle because it had caught up is not kicked
        # the instant a burst pushes it over.
        start = r.last_progress_ns
        if over_hard_since_ns is not None and over_hard_since_ns > start:
            start = over_hard_since_ns
        if now_ns - start > cfg.kick_grace_ms * 1_000_000:
            return ReceiverState.KICK
        return ReceiverState.LAGGING

    def receiver_state(self, rid: Hashable, now_ns: int) -> ReceiverState:
        """Classify ``rid`` per docs/design/byte-ring.md §4 without changing anything. A receiver over the
        hard threshold that ``check_lagging`` has not seen there yet is ``LAGGING`` (its window starts
        at that check)."""
        r = self._get(rid)
        since = r.over_hard_since_ns if r.over_hard_since_ns is not None else now_ns
        return self._classify(r, now_ns, since)

    def receiver_info(self, rid: Hashable, now_ns: int) -> ReceiverInfo:
        r = self._get(rid)
        return ReceiverInfo(
            rid=rid,
            lag=self._write_pos - r.read_pos,
            in_flight=r.send_pos - r.read_pos,
            state=self.receiver_state(rid, now_ns),
            bytes_sent=r.bytes_sent,
        )

    def check_lagging(self, now_ns: int) -> list[Hashable]:
        """Apply docs/design/byte-ring.md §4 to every receiver: remove those to disconnect and return their
        ids.

        The returned receivers are already removed (counted in ``disconnections_lag``): the caller
        must drop their connections at once, discarding what their transports still buffer
        (``transport.abort()``), because their bytes may be overwritten by the next write. Call
        ``update_flow`` afterwards. Cheap: a loop over at most ``max_receivers``; call it after each
        write and on a periodic timer (a kick can happen with no write at all).
        """
        hard = self._cfg.hard_lag_bytes
        wp = self._write_pos
        kicked: list[Hashable] = []
        for rid, r in self._receivers.items():
            if wp - r.read_pos <= hard:
                r.over_hard_since_ns = None
                continue
            if r.over_hard_since_ns is None:
                r.over_hard_since_ns = now_ns
            if self._classify(r, now_ns, r.over_hard_since_ns) is ReceiverState.KICK:
                kicked.append(rid)
        for rid in kicked:
            del self._receivers[rid]
        self._disconnections_lag += len(kicked)
        return kicked

    # --------------------------------------------------------------- sender
    def reserve(self) -> memoryview:
        """Lend the free memory at ``write_pos`` for a zero-copy recv: at most ``recv_chunk_bytes``,
        contiguous (so it may be short just before the wrap), never a byte a receiver has not read.
        Fill it, then ``commit(n)``; a later ``reserve`` or ``write`` cancels an uncommitted one.
        In drain mode the memory is scratch. Raises ``BufferError`` when the ring is full, which
        cannot happen while the ``update_flow`` contract is kept and the sender is not paused.
        """
        cap = self._cap
        off = self._write_pos % cap
        n = min(self._cfg.recv_chunk_bytes, cap - off)
        if self._receivers:
            n = min(n, self.free_bytes)
            if n == 0:
                raise BufferError("ring is full: the sender must be paused (call update_flow)")
        self._reserved = n
        return self._view[off : off + n]

    def commit(self, nbytes: int) -> int:
        """Take ``nbytes`` filled into the last ``reserve()`` view. Returns the bytes stored: all of
        them, or 0 in drain mode where they are counted in ``bytes_dropped_no_receiver``."""
        if not 0 <= nbytes <= self._reserved:
            raise ValueError(f"commit({nbytes}): only {self._reserved} bytes were reserved")
        self._reserved = 0
        self._bytes_received += nbytes
        if not self._receivers:
            self._bytes_dropped += nbytes
            return 0
        self._write_pos += nbytes
        return nbytes

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Copy ``data`` into the ring (the copying twin of ``reserve``/``commit``).

        Returns the bytes accepted from the front of ``data``: at most ``free_bytes`` (never
        overwriting an unread byte); the caller keeps the rest and pauses the sender. In drain mode
        every byte is accepted and dropped (counted in ``bytes_dropped_no_receiver``).
        """
        self._reserved = 0
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        total = mv.nbytes
        if not self._receivers:
            self._bytes_received += total
            self._bytes_dropped += total
            return total
        n = min(total, self.free_bytes)
        cap = self._cap
        off = self._write_pos % cap
        first = min(n, cap - off)
        self._view[off : off + first] = mv[:first]
        if n > first:
            self._view[: n - first] = mv[first:n]
        self._write_pos += n
        self._bytes_received += n
        return n

    def update_flow(self, now_ns: int) -> FlowAction | None:
        """Apply docs/design/byte-ring.md §5 with hysteresis and return the transition, if any::

            pause  when used >= capacity * pause_pct / 100  or free <  recv_chunk_bytes
            resume when used <= capacity * resume_pct / 100 and free >= 2 * recv_chunk_bytes

        (integer division, docs/design/byte-ring.md §5.1). Counts pauses and paused time.
        """
        cfg = self._cfg
        used = self.used_bytes
        free = self._cap - used
        if not self._paused:
            if used >= cfg.pause_threshold_bytes or free < cfg.recv_chunk_bytes:
                self._paused = True
                self._paused_since_ns = now_ns
                self._pause_count += 1
                return FlowAction.PAUSE
            return None
        if used <= cfg.resume_threshold_bytes and free >= 2 * cfg.recv_chunk_bytes:
            self._paused = False
            self._pause_ns += max(0, now_ns - self._paused_since_ns)
            return FlowAction.RESUME
        return None

    # -------------------------------------------------------------- metrics
    def metrics(self, now_ns: int | None = None) -> RingMetrics:
        """Metrics of docs/design/byte-ring.md §8. With ``now_ns``, a pause in progress counts in
        ``sender_recv_pause_ns``."""
        pause_ns = self._pause_ns
        if self._paused and now_ns is not None:
            pause_ns += max(0, now_ns - self._paused_since_ns)
        wp = self._write_pos
        max_lag = max((wp - r.read_pos for r in self._receivers.values()), default=0)
        return RingMetrics(
            bytes_received=self._bytes_received,
            bytes_sent=self._bytes_sent,
            bytes_dropped_no_receiver=self._bytes_dropped,
            active_receivers=len(self._receivers),
            total_connections=self._total_connections,
            disconnections_lag=self._disconnections_lag,
            # used_bytes = write_pos - min(read_pos) is the largest lag (docs/design/byte-ring.md §3).
            ring_buffer_used=max_lag,
            max_receiver_lag=max_lag,
            sender_recv_pause_count=self._pause_count,
            sender_recv_pause_ns=pause_ns,
        )

    def __repr__(self) -> str:
        return (
            f"<ByteRing capacity={self._cap} write_pos={self._write_pos} used={self.used_bytes} "
            f"receivers={len(self._receivers)} paused={self._paused}>"
        )
