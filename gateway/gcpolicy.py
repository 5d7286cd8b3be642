"""Garbage-collector policy: keep full collections rare, and measure every collector pause.

At 1,000 WebSocket clients the gateway holds a few hundred thousand long-lived objects (connections,
protocol state, subscriptions). CPython's automatic full collection walks all of them every few seconds and
stalled every client for ~100 ms each time (docs/benchmarks.md). So every second whatever survived is
frozen out of the collector's reach (`gc.freeze`, O(1): it splices lists), young collections stay automatic
and cheap, and a full collection of everything (unfreeze, collect, freeze) runs every
`server.gc_full_interval_s`, so cyclic garbage left by closed connections is still reclaimed and memory
stays bounded by what one interval leaves behind.
"""

from __future__ import annotations

import asyncio
import gc
import time

from .metrics import BucketHistogram

GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
#: how often survivors are frozen: often enough that the automatic full collection never has much to walk
FREEZE_PERIOD_S = 1.0


class GcPolicy:
    def __init__(self, full_interval_s: float) -> None:
        self.full_interval_s = full_interval_s
        #: collector pauses by generation (2 includes the periodic full collections)
        self.pauses = {gen: BucketHistogram(GC_BUCKETS) for gen in (0, 1, 2)}
        self.full_collections = 0
        self._started_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._next_full = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
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
            self._next_full = loop.time() + self.full_interval_s
        self._timer = loop.call_later(min(FREEZE_PERIOD_S, self.full_interval_s), self._on_timer)

    def _on_timer(self) -> None:
        if asyncio.get_running_loop().time() >= self._next_full:
            self.full_collection()
        else:
            gc.freeze()
        self._schedule()

    def full_collection(self) -> None:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.full_collections += 1
        self._next_full = 0.0

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            gc.unfreeze()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
