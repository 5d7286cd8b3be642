"""Deadlines of many connections on one event-loop timer: a bucketed timer wheel.

An asyncio timer costs an idle connection ~600 bytes (uvloop: the `TimerHandle`, its libuv timer, a copy of
the context, the bound method and its arguments), and an idle WebSocket held two (keepalive ping, idle
check) and an authenticated one a third (token expiry). A `TimerWheel` keeps each deadline as one entry of a
dict, rounded up to the wheel's `resolution`: deadlines that fall in the same tick share a bucket, and the
wheel runs one loop timer, for its earliest bucket. Scheduling and cancelling are O(1) (a new bucket:
O(log buckets)); a tick costs what is due in it, never a walk of every connection.

A deadline fires at or after its time, at most one `resolution` late, never early; the deadlines of one tick
fire in the order they were scheduled. Each key holds at most one deadline (scheduling again moves it), with
a value handed to `fire` with the key; a deadline scheduled while its tick fires goes to the next tick.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

log = logging.getLogger("gateway")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TimerWheel(Generic[K, V]):
    __slots__ = ("resolution", "fire", "_due", "_buckets", "_ticks", "_handle", "_armed", "_firing", "_loop", "fired", "wakeups")

    def __init__(self, fire: Callable[[K, V], None], resolution: float = 1.0) -> None:
        if not resolution > 0:
            raise ValueError("a timer wheel's resolution must be positive")
        self.resolution = resolution
        #: called with the key and its value when a deadline is due
        self.fire = fire
        #: key -> the tick its deadline is in
        self._due: dict[K, int] = {}
        #: tick -> {key: value}, in the order of scheduling
        self._buckets: dict[int, dict[K, V]] = {}
        #: the ticks of the buckets, a heap (a tick whose bucket was emptied stays until it is reached)
        self._ticks: list[int] = []
        self._handle: asyncio.TimerHandle | None = None
        #: the tick the loop timer is set for
        self._armed: int | None = None
        #: the tick firing now (`_run`), else -1: what is scheduled meanwhile goes to a later tick
        self._firing = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        #: deadlines fired and loop timers run, since the start (tests, and what a tick costs)
        self.fired = 0
        self.wakeups = 0

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def schedule(self, key: K, delay: float, value: V) -> None:
        """`key`'s deadline, `delay` seconds from now (replacing the one it had), fires `fire(key, value)`."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + max(0.0, delay)) / self.resolution)
        if tick <= self._firing:
            tick = self._firing + 1
        due = self._due
        old = due.get(key)
        if old is not None:
            if old == tick:
                self._buckets[tick][key] = value
                return
            self._discard(key, old)
        due[key] = tick
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = {}
            heapq.heappush(self._ticks, tick)
            if self._firing < 0 and (self._armed is None or tick < self._armed):  # `_run` arms once it is done
                self._arm(loop, tick)
        bucket[key] = value

    def cancel(self, key: K) -> bool:
        """Forget `key`'s deadline; False when it had none."""
        tick = self._due.pop(key, None)
        if tick is None:
            return False
        self._discard(key, tick)
        return True

    def get(self, key: K) -> V | None:
        """The value of `key`'s pending deadline, None when it has none."""
        tick = self._due.get(key)
        if tick is None:
            return None
        bucket = self._buckets.get(tick)
        return bucket.get(key) if bucket is not None else None

    def close(self) -> None:
        """Forget every deadline and stop the loop timer."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._armed = None
        self._due.clear()
        self._buckets.clear()
        self._ticks.clear()

    def _discard(self, key: K, tick: int) -> None:
        bucket = self._buckets.get(tick)
        if bucket is None:  # the bucket firing now: its loop skips keys no longer due in it
            return
        bucket.pop(key, None)
        if not bucket:
            del self._buckets[tick]  # its tick stays in the heap until reached (one wake-up at most)

    def _arm(self, loop: asyncio.AbstractEventLoop, tick: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = tick
        self._handle = loop.call_at(tick * self.resolution, self._run)

    def _run(self) -> None:
        assert self._loop is not None and self._armed is not None
        self._handle = None
        self.wakeups += 1
        # the loop may run a timer a little early (uvloop: whole milliseconds): the armed tick is due anyway
        now = max(self._armed, math.floor(self._loop.time() / self.resolution))
        self._armed = None
        ticks, buckets, due = self._ticks, self._buckets, self._due
        try:
            while ticks and ticks[0] <= now:
                tick = heapq.heappop(ticks)
                bucket = buckets.pop(tick, None)
                if not bucket:
                    continue
                self._firing = tick
                for key, value in bucket.items():
                    if due.get(key) != tick:  # cancelled, or moved to another tick, by an earlier one
                        continue
                    del due[key]
                    self.fired += 1
                    try:
                        self.fire(key, value)
                    except Exception:  # one deadline's failure must not stop the others (asyncio logs it too)
                        log.exception("timer wheel: deadline of %r failed", key)
        finally:
            self._firing = -1
            while ticks and ticks[0] not in buckets:
                heapq.heappop(ticks)
            if ticks:
                self._arm(self._loop, ticks[0])
