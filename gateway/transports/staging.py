"""Writes staged for a scheduler round: one write call per connection per round, not one per cycle.

While a backlog lasts, the scheduler runs several cycles as one round (`scheduler.write_coalesce_cycles`, at most
`scheduler.write_coalesce_ms`; reads still run between them) and each connection's frames of those cycles go
out together at the round's end, by `transport.writelines` (one `writev` on uvloop); a client caught up
(nothing for it next cycle: `Batch.more` false) is written at once, or after its cycle when frames
of the round wait before its batch, so nobody waits for another's backlog. The frames are the
cycles' frames, in order, one batch each: the scheduler's rules and the wire do not change, only the number
of system calls (docs/architecture.md, "Rounds"). With no backlog a round is one cycle, written at once.
Frames written outside the scheduler (pongs, pings, SSE heartbeats) are whole frames, so they may go between
two rounds' frames; a close goes after the staged frames (`kick` writes them first).

A connection's batches are reported done when staged, so it takes part in the round's next cycle. When the
round's write leaves its transport above the high-water mark the scheduler makes it not ready until the transport
drains, as a direct write would. Staged bytes are bounded by the high-water mark: past it, the connection is
written at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..scheduler import Delivered
from ..session import ClientSession

if TYPE_CHECKING:
    from core import Batch

    from ..auth.identity import ClientIdentity


#: an enum member's lookup costs ~0.1 µs: these are read once per batch
DONE, STAGED, CAUGHT_UP, BLOCKED = Delivered.DONE, Delivered.STAGED, Delivered.CAUGHT_UP, Delivered.BLOCKED


class WritePause(Protocol):
    """Who keeps a connection's write pause: whoever asyncio's `pause_writing` and `resume_writing` reach (the
    WebSocket protocol; an SSE stream, which its HTTP protocol tells). A `StagedWriter` only reads it."""

    #: the transport is above its high-water mark (`pause_writing` until `resume_writing`)
    paused: bool


class StagedWriter:
    """The write side of a streaming connection (WebSocket, SSE): staging and flow control; the class names
    its transport. Made with its client's `ClientSession` (gateway/session.py), which hears of its write
    state, and with the keeper of its write pause (`WritePause`)."""

    __slots__ = ("session", "scheduler", "identity", "pause", "blocked_since", "_staged", "_staged_bytes")

    def __init__(self, session: ClientSession, pause: WritePause) -> None:
        self.session = session
        self.scheduler = session.scheduler
        self.identity: ClientIdentity = session.identity
        #: whose `paused` says the transport is above its high-water mark (read here, never set)
        self.pause = pause
        #: set while a batch waits for the transport to drain (the client is not ready)
        self.blocked_since: float | None = None
        self._staged: list[bytes] = []  # this round's frames, not written yet
        self._staged_bytes = 0

    def _stream(self) -> asyncio.Transport | None:
        """The transport to write, or None when nothing may be written any more (closed, closing)."""
        raise NotImplementedError

    # the rest of the scheduler's `Connection`, which each transport's class implements
    def deliver(self, batch: Batch, frame: bytes) -> Delivered:
        raise NotImplementedError

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def _blocked(self) -> None:
        """A write left the transport above its high-water mark: not ready, and watched, until it drains."""
        self.blocked_since = time.monotonic()
        self.session.blocked()

    def _drained(self) -> None:
        """The transport drained below its low-water mark: a blocked client is ready again."""
        if self.blocked_since is not None:
            self.blocked_since = None
            self.session.drained()

    def _written(self) -> None:
        """Called after each write of staged data."""

    def _staging(self, staged: bool) -> None:
        """Frames were staged (True: later frames must go behind them), or the staged ones were written."""

    def write_batch(self, parts: tuple[bytes, ...], size: int, more: bool) -> Delivered:
        """A batch's bytes (`parts`, `size` in all, none copied). While the client has more to come next cycle
        (`Batch.more`) they are staged for the round's write (STAGED); for a client caught up they are written
        now (DONE), or, behind frames staged earlier in the round, after this cycle (CAUGHT_UP). BLOCKED: a
        write left the transport above its high-water mark."""
        staged = self._staged
        if not staged:
            if not more:
                return DONE if self._write_parts(parts) else BLOCKED
            self._staged_bytes = 0
            staged += parts
            self._staging(True)
        else:
            staged += parts
        self._staged_bytes += size
        if self._staged_bytes >= self.scheduler.stage_limit and not self.flush():
            return BLOCKED
        return STAGED if more else CAUGHT_UP

    def flush(self) -> bool:
        """Write what is staged, in one call. Returns False when the write left the transport above its
        high-water mark: the client is blocked until `resume_writing`."""
        staged = self._staged
        if not staged:  # nothing since the last write (one written at the stage limit reported itself)
            return True
        self._staged = []
        self._staging(False)
        if self.scheduler.delivery_log is not None:
            self.scheduler.delivery_log.written(self)
        return self._write_parts(staged)

    def _write_parts(self, parts: Sequence[bytes]) -> bool:
        """One write call (`writelines`: one `writev` on uvloop). False when nothing may be written any more,
        or when the write left the transport above its high-water mark (the client is blocked until
        `resume_writing`)."""
        transport = self._stream()
        if transport is None:
            return False
        if len(parts) == 1:
            transport.write(parts[0])
        else:
            transport.writelines(parts)
        self.scheduler.staged_writes += 1
        self._written()
        if self.pause.paused:  # pause_writing ran inside the write: above the high-water mark
            self._blocked()
            return False
        return True
