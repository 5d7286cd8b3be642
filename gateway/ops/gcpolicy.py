"""Garbage-collector policy: keep full collections rare, and measure every collector pause.

At 1,000 WebSocket clients the gateway holds a few hundred thousand long-lived objects (connections,
protocol state, subscriptions). CPython's automatic full collection walks all of them every few seconds and
stalled every client for ~100 ms each time (docs/benchmarks-history.md, "Targets at a glance"). So every
second whatever survived is frozen out of the collector's reach (`gc.freeze`, O(1): it splices lists), young
collections stay automatic and cheap, and a full collection of everything (unfreeze, collect, freeze) runs
every `server.gc_full_interval_s` in which a connection closed, so cyclic garbage left by closed connections
is still reclaimed and memory stays bounded by what one interval leaves behind; with none closed it runs every
`QUIET_INTERVALS` intervals (there is little to reclaim, and it stalls every client: ~100 ms at 10,000).

Memory given back: after a full collection the C allocator is asked to return its free pages to the
system (`malloc_trim`, glibc), and when many connections have closed since the last full collection (at
least `DEPARTURES_MIN`, and half of those open then), the full collection runs at the first freeze tick
with no new departure (the crowd has left) instead of waiting for the interval, so a crowd that leaves
gives its memory back within seconds.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from .metrics import BucketHistogram

GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
#: how often survivors are frozen: often enough that the automatic full collection never has much to walk
FREEZE_PERIOD_S = 1.0
#: departures that make a full collection worth running early: below this, the interval's one is soon enough
DEPARTURES_MIN = 1000
#: with no connection gone since the last full collection, the interval's one waits up to this many intervals:
#: what it reclaims comes mostly from closed connections, and it stalls every client for as long as it walks
#: everything alive (~100 ms at 10,000 WebSocket clients)
QUIET_INTERVALS = 10

log = logging.getLogger("gateway")


def _malloc_trim() -> object:
    """glibc's malloc_trim, or None elsewhere (musl, macOS): returning free pages is then the allocator's."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
    return trim


MALLOC_TRIM = _malloc_trim()


class GcPolicy:
    def __init__(self, full_interval_s: float) -> None:
        self.full_interval_s = full_interval_s
        #: collector pauses by generation (2 includes the periodic full collections)
        self.pauses = {gen: BucketHistogram(GC_BUCKETS) for gen in (0, 1, 2)}
        self.full_collections = 0
        self._started_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._next_full = 0.0
        #: connections open at the last full collection, and closed since
        self.open = 0
        self._open_at_full = 0
        self._departures = 0
        self._departures_at_tick = 0

    def arrived(self) -> None:
        self.open += 1

    def departed(self) -> None:
        self.open -= 1
        self._departures += 1

    def _crowd_left(self) -> bool:
        """Many left since the last full collection, and nobody since the last tick: the wave is over."""
        settled = self._departures == self._departures_at_tick
        self._departures_at_tick = self._departures
        return settled and self._departures >= max(DEPARTURES_MIN, self._open_at_full // 2)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
        else:
            self.pauses[info["generation"]].observe(time.perf_counter() - self._started_at)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        if self.full_interval_s > 0:
            gc.collect()
            gc.freeze()
            self._schedule()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._next_full:
            self._next_full = time.monotonic() + self.full_interval_s
        self._timer = loop.call_later(min(FREEZE_PERIOD_S, self.full_interval_s), self._on_timer)

    def _on_timer(self) -> None:
        if self._crowd_left() or self._interval_due(time.monotonic()):
            self.full_collection()
        else:
            gc.freeze()
        self._schedule()

    def _interval_due(self, now: float) -> bool:
        """The interval's full collection: once an interval has passed with a departure since the last one,
        or `QUIET_INTERVALS` intervals without."""
        if now < self._next_full:
            return False
        return self._departures > 0 or now >= self._next_full + (QUIET_INTERVALS - 1) * self.full_interval_s

    def full_collection(self) -> None:
        # CPython 3.11's attribute-lookup cache (4,096 entries) keeps a reference to the name string of each
        # lookup, keyed by the string's address: C code that looks an attribute up by a C string makes a new
        # name each time (websockets' handshake `Date` header: datetime's `tzinfo.dst`, once per connection),
        # and those names stay scattered over the memory of whatever was allocated beside them. After a crowd
        # of 10,000 connections they were hundreds of 64-byte strings, each keeping a 1 MiB arena of the
        # small-object allocator from being returned. Emptying the cache costs a few thousand lookups.
        sys._clear_type_cache()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        if MALLOC_TRIM is not None:
            MALLOC_TRIM(0)  # type: ignore[operator]
        self.full_collections += 1
        self._next_full = time.monotonic() + self.full_interval_s
        self._open_at_full = self.open
        self._departures = self._departures_at_tick = 0

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            gc.unfreeze()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def collect(self) -> Iterator[Metric]:
        pauses = HistogramMetricFamily("fanout_gc_pause_seconds", "garbage-collector pauses", labels=["generation"])
        for generation, histogram in self.pauses.items():
            pauses.add_metric([str(generation)], histogram.cumulative(), sum_value=histogram.total)
        yield pauses
        yield CounterMetricFamily(
            "fanout_gc_full_collections", "periodic full collections (gcpolicy)", value=self.full_collections
        )
