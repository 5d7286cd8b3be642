"""Prometheus metrics (prometheus-client), read from the core's plain counters at scrape time.

The hot path only bumps plain integers; the collector turns them into metric families when /metrics is
scraped, so exporting costs nothing per message.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

import core

if TYPE_CHECKING:
    from core import Batch

    from .hub import Hub
    from .netguard import ConnectionLimiter

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
    def __init__(self, hub: "Hub") -> None:
        self.hub = hub
        self.cycle_seconds = BucketHistogram(CYCLE_BUCKETS)
        self.entries_per_batch = BucketHistogram(BATCH_BUCKETS)
        self.clients_by_transport: Counter[str] = Counter()
        self.disconnects: Counter[tuple[str, str]] = Counter()
        self.ingest_records = 0
        self.ingest_errors = 0
        #: the HTTP port's connection accounting, set by the server once it listens
        self.connections: "ConnectionLimiter | None" = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def connected(self, transport: str) -> None:
        self.clients_by_transport[transport] += 1

    def disconnected(self, transport: str, reason: str) -> None:
        self.clients_by_transport[transport] -= 1
        self.disconnects[(transport, reason)] += 1

    def cycle(self, seconds: float, batches: "list[Batch]") -> None:
        self.cycle_seconds.observe(seconds)
        observe = self.entries_per_batch.observe
        for batch in batches:
            observe(len(batch.entries))

    def write_blocked(self) -> int:
        return len(self.hub.blocked)

    def collect(self) -> Iterator[Metric]:
        counters = self.hub.engine.counters.as_dict()
        for name, value in counters.items():
            yield CounterMetricFamily(f"fanout_{name}", f"core counter {name}", value=value)
        clients = GaugeMetricFamily("fanout_clients", "connected clients", labels=["transport"])
        for transport, count in sorted(self.clients_by_transport.items()):
            clients.add_metric([transport], count)
        yield clients
        disconnects = CounterMetricFamily("fanout_disconnects", "disconnects by reason", labels=["transport", "reason"])
        for (transport, reason), count in sorted(self.disconnects.items()):
            disconnects.add_metric([transport, reason], count)
        yield disconnects
        yield GaugeMetricFamily("fanout_write_blocked_clients", "clients whose write has not drained", value=self.write_blocked())
        yield GaugeMetricFamily("fanout_topics", "topics", value=self.hub.engine.topic_count)
        yield CounterMetricFamily("fanout_ingest_records", "records accepted on the TCP ingest", value=self.ingest_records)
        yield CounterMetricFamily("fanout_ingest_errors", "error lines sent on the TCP ingest", value=self.ingest_errors)
        bad = CounterMetricFamily("fanout_bad_input", "bad client input by source (logged at a bounded rate)",
                                  labels=["source"])
        for source, count in sorted(self.hub.bad_input.by_source.items()):
            bad.add_metric([source], count)
        yield bad
        limiter = self.connections
        if limiter is not None:
            yield GaugeMetricFamily("fanout_http_connections", "open HTTP-port connections (WebSocket included)",
                                    value=limiter.open)
            refused = CounterMetricFamily("fanout_connections_refused",
                                          "HTTP-port connections refused at a limit or cut at the header deadline",
                                          labels=["reason"])
            for reason, count in sorted(limiter.refused.items()):
                refused.add_metric([reason], count)
            yield refused
        creations = CounterMetricFamily("fanout_topic_creations_refused",
                                        "client topic creations refused (too_many_topics) by bound: connection"
                                        " (limits.max_created_topics), address (limits.topic_create_rate), total"
                                        " (limits.max_client_topics), cluster (broker.max_topics)", labels=["bound"])
        for bound, count in sorted(self.hub.creations.refused.items()):
            creations.add_metric([bound], count)
        yield creations
        broker = self.hub.broker
        if broker.distributed:
            yield GaugeMetricFamily("fanout_broker_pending_bytes", "bytes of publishes waiting for Redis"
                                    " (bounded by broker.max_pending_bytes)", value=broker.pending_bytes)
            yield CounterMetricFamily("fanout_broker_backlog_refused", "publishes refused (broker_unavailable) because"
                                      " broker.max_pending_bytes wait for Redis", value=broker.backlog_refused)
        yield CounterMetricFamily("fanout_rounds", "scheduler rounds (cycles written together, gateway/transports/staging.py)",
                                  value=self.hub.rounds)
        yield CounterMetricFamily("fanout_staged_writes", "write calls of staged batches (WebSocket, SSE)",
                                  value=self.hub.staged_writes)
        yield from self._byte_bounds()
        yield GaugeMetricFamily("fanout_core_compiled", "1: the core's mypyc-compiled modules run; 0: their Python "
                                "sources (`gateway serve` prints why)", value=int(core.COMPILED))
        yield self.cycle_seconds.family("fanout_cycle_duration_seconds", "run_cycle plus hand-off time")
        yield self.entries_per_batch.family("fanout_entries_per_batch", "entries per batch written")
        pauses = HistogramMetricFamily("fanout_gc_pause_seconds", "garbage-collector pauses", labels=["generation"])
        for generation, histogram in self.hub.gc.pauses.items():
            pauses.add_metric([str(generation)], histogram.cumulative(), sum_value=histogram.total)
        yield pauses
        yield CounterMetricFamily("fanout_gc_full_collections", "periodic full collections (gcpolicy)",
                                  value=self.hub.gc.full_collections)
        raw = self.hub.raw
        if raw is not None:
            for name, value in raw.stats().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield GaugeMetricFamily(f"fanout_raw_{name}", f"raw TCP broadcaster {name} (docs/design/byte-ring.md §8)",
                                            value=value)

    def _byte_bounds(self) -> Iterator[Metric]:
        """What peers make the gateway hold or spend, against their bounds (docs/security.md, issue 24)."""
        from .transports.ingest import ingest_counters
        from .transports.ws import ws_counters

        yield GaugeMetricFamily("fanout_direct_queue_bytes", "bytes in all clients' direct queues (replies, acks,"
                                " errors; bounded by scheduler.direct_total_max_bytes)",
                                value=self.hub.engine.direct_bytes)
        yield CounterMetricFamily("fanout_ws_pongs_coalesced", "pongs not written: a later ping came while the"
                                  " client's writes were paused (one pong waits)", value=ws_counters.pongs_coalesced)
        yield CounterMetricFamily("fanout_ws_fragment_closes", "connections closed (1008) for a message in more"
                                  " than websocket.max_fragments frames", value=ws_counters.fragment_closes)
        yield CounterMetricFamily("fanout_ws_input_deferrals", "times a WebSocket client's input was left for the"
                                  " next turn of the event loop (its share of the turn spent)",
                                  value=ws_counters.input_deferrals)
        yield CounterMetricFamily("fanout_ingest_answer_pauses", "times a publisher's unread answers reached"
                                  " ingest.max_answer_bytes (its records waited)", value=ingest_counters.answer_pauses)
        yield CounterMetricFamily("fanout_auth_rate_limited", "token checks refused past auth.rate_per_ip",
                                  value=self.hub.tokens.per_address.refused)

    def render(self) -> bytes:
        return generate_latest(self.registry)
