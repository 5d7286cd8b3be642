"""Garbage-collector policy: keep full collections rare, and measure every collector pause.

At 1,000 WebSocket clients the gateway holds a few hundred thousand long-lived objects (connections,
protocol state, subscriptions). CPython's automatic full collection walks all of them every few seconds and
stalled every client for ~100 ms each time (docs/benchmarks.md). Long-lived objects are therefore frozen
out of the collector's reach (`gc.freeze`), young collections stay automatic and cheap, and a full
collection of everything (unfreeze, collect, freeze) runs every `server.gc_full_interval_s`, so cyclic
garbage left by closed connections is still reclaimed and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import gc
import time

from .metrics import _Histogram

GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class GcPolicy:
    def __init__(self, full_interval_s: float) -> None:
        self.full_interval_s = full_interval_s
        #: collector pauses by generation (2 includes the periodic full collections)
        self.pauses = {gen: _Histogram(GC_BUCKETS) for gen in (0, 1, 2)}
        self.full_collections = 0
        self._started_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

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
        self._timer = asyncio.get_running_loop().call_later(self.full_interval_s, self.full_collection)

    def full_collection(self) -> None:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.full_collections += 1
        self._schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            gc.unfreeze()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
