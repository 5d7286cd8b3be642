"""Prometheus metrics (prometheus-client), read from plain counters at scrape time.

The hot path only bumps plain integers; at scrape time each part's collector (the scheduler's, the client
registry's, the functions below for the engine, the broker, the limits) turns them into metric families, so
exporting costs nothing per message. Each part is registered by the hub (`Metrics.add`); this module reads
none of them itself.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

import core

if TYPE_CHECKING:
    from ..topic_view import TopicView

CYCLE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BucketHistogram:
    """A bucket counter cheap enough for every batch (prometheus' own observe costs more per call)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def observe_many(self, value: float, count: int) -> None:
        """`count` observations of the same value in one call."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def cumulative(self) -> list[tuple[str, int]]:
        buckets, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", running + self.counts[-1]))
        return buckets

    def snapshot(self) -> dict[str, Any]:
        """Read-only copy for the admin stats stream: upper bounds, per-bucket (not cumulative) counts, the
        last one above every bound, and the sum."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(name, doc, buckets=self.cumulative(), sum_value=self.total)


class Metrics:
    """The registry /metrics renders: the collectors each part registered."""

    def __init__(self) -> None:
        self._collectors: list[Callable[[], Iterable[Metric]]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def add(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collectors.append(collect)

    def collect(self) -> Iterator[Metric]:
        for collect in self._collectors:
            yield from collect()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_families(topics: "TopicView") -> Iterator[Metric]:
    for name, value in topics.counters.as_dict().items():
        yield CounterMetricFamily(f"fanout_{name}", f"core counter {name}", value=value)
    yield GaugeMetricFamily("fanout_topics", "topics", value=topics.topic_count)
    yield GaugeMetricFamily(
        "fanout_direct_queue_bytes",
        "bytes in all clients' direct queues (replies, acks, errors; bounded by scheduler.direct_total_max_bytes)",
        value=topics.direct_bytes,
    )
    yield GaugeMetricFamily(
        "fanout_core_compiled",
        "1: the core's mypyc-compiled modules run; 0: their Python sources (`gateway serve` prints why)",
        value=int(core.COMPILED),
    )


def counter_family(name: str, doc: str, label: str, counts: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, count in sorted(counts.items()):
        family.add_metric([key], count)
    return family


def loop_families() -> Iterator[Metric]:
    """The process's asyncio tasks: a soak's leak shows here before it shows in memory."""
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # scraped outside the event loop (a test)
        return
    yield GaugeMetricFamily("fanout_event_loop_tasks", "asyncio tasks alive in this process", value=tasks)


def stats_families(prefix: str, doc: str, stats: Mapping[str, Any]) -> Iterator[Metric]:
    """A part's numeric stats as gauges (the raw TCP broadcaster's)."""
    for name, value in stats.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield GaugeMetricFamily(f"{prefix}{name}", f"{doc} {name}", value=value)
