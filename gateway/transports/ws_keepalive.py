"""WebSocket keepalive: a ping every `websocket.ping_interval_s`, a close when its pong does not come within
`websocket.ping_timeout_s`, every connection's deadline on one timer wheel per server.

A ping that falls due is not sent while frames flow and the peer's TCP acknowledges them: its ACKs within
the interval prove the peer and the path alive, as a pong would (a ping costs a write and a pong's parse,
~3% of the CPU of 10,000 clients at 5 messages a second). A peer gone silent stops acknowledging: it is
pinged at the next deadline. Each ping carries a random payload, so a stale or unsolicited pong is ignored.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from typing import Protocol

from ..timerwheel import TimerWheel
from .streams import peer_acked_within
from .ws_counters import ws_counters

#: what a connection's deadline on the wheel is: the next ping, or the pong of the last one
PING, PONG = 0, 1

#: the wheel's longest tick. Connections made together ping together, and a tick fires its pings in one
#: callback: at a second, a crowd of 10,000 made within 3 s sent ~3,300 pings in one go (~60 ms with nothing
#: else running, once per ping interval); at 50 ms a tick holds a twentieth of that.
KEEPALIVE_TICK_S = 0.05


def keepalive_resolution(interval: float | None, timeout: float | None) -> float:
    """The wheel's tick: `KEEPALIVE_TICK_S`, or a twentieth of the shorter of the ping interval and timeout
    (a ping or its timeout is then at most 5% late)."""
    periods = [p for p in (interval, timeout) if p is not None and p > 0]
    return min([KEEPALIVE_TICK_S, *(p / 20 for p in periods)])


class KeptAlive(Protocol):
    """What the keepalive needs of a connection (gateway/transports/ws.py); the ping state is the
    connection's own, so an idle connection holds no timer and no object of ours for it."""

    ping_payload: bytes | None
    ping_sent_at: float
    ping_rtt: float
    #: whose socket says when the peer's TCP last acknowledged
    transport: asyncio.Transport

    def __hash__(self) -> int: ...

    def can_ping(self) -> bool:
        """Neither closing nor closed."""

    def frames_flowed(self) -> bool:
        """Frames were sent to the peer since the last time this was asked."""

    def write_ping(self, payload: bytes) -> None:
        """Write a ping frame carrying `payload`."""

    def keepalive_timed_out(self) -> None:
        """The pong did not come in time: close the connection (1011)."""


class Keepalive:
    """One server's keepalive deadlines; `start` when a connection opens, `stop` when it closes."""

    __slots__ = ("interval", "timeout", "wheel")

    def __init__(self, interval: float | None, timeout: float | None) -> None:
        self.interval = interval or None
        self.timeout = timeout or None
        self.wheel: TimerWheel[KeptAlive, int] = TimerWheel(self._due, keepalive_resolution(interval, timeout))

    def start(self, peer: KeptAlive) -> None:
        if self.interval is not None:
            self._schedule_ping(peer)

    def stop(self, peer: KeptAlive) -> None:
        self.wheel.cancel(peer)
        peer.ping_payload = None

    def pong(self, peer: KeptAlive, payload: bytes) -> None:
        """A pong came: the one of the ping in flight ends its deadline, and the next ping is scheduled."""
        if peer.ping_payload is None or payload != peer.ping_payload:
            return
        peer.ping_rtt = time.monotonic() - peer.ping_sent_at
        peer.ping_payload = None
        if self.wheel.get(peer) == PONG:  # without a ping timeout the next ping is scheduled already
            self._schedule_ping(peer)

    def _schedule_ping(self, peer: KeptAlive) -> None:
        assert self.interval is not None
        self.wheel.schedule(peer, max(0.0, self.interval - peer.ping_rtt), PING)

    def _due(self, peer: KeptAlive, due: int) -> None:
        if due == PONG:
            peer.ping_payload = None
            peer.keepalive_timed_out()
            return
        if not peer.can_ping():
            return
        assert self.interval is not None
        if peer.frames_flowed() and peer_acked_within(peer.transport, self.interval):
            ws_counters.pings_skipped += 1
            self._schedule_ping(peer)
            return
        peer.ping_payload = payload = struct.pack("!I", random.getrandbits(32))
        peer.ping_sent_at = time.monotonic()
        peer.write_ping(payload)
        if self.timeout is not None:
            self.wheel.schedule(peer, self.timeout, PONG)
        else:
            self._schedule_ping(peer)
