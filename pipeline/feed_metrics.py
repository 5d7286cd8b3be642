"""The feed's metrics as a Prometheus textfile (``--metrics-file PATH``), for node_exporter's textfile
collector or anything that reads the exposition format: rewritten whole (temporary file, then rename) after
every micro-batch and when the query reports progress.

Spark's own figures come from a ``StreamingQueryListener`` (input and processing rows/s, the micro-batch's
duration); the feed adds its outcome counts (delivered, lost, already present, bad), reconnects, gateway
restarts, the time spent publishing, and the event-time lag (now - the newest ``event_time`` of the last
micro-batch: how far behind its source the feed runs).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQueryListener
    from pyspark.sql.streaming.listener import (
        QueryIdleEvent,
        QueryProgressEvent,
        QueryStartedEvent,
        QueryTerminatedEvent,
    )

    from pipeline.ledger import BatchOutcome

__all__ = ["FeedMetrics"]

_HELP = {
    "fanout_feed_up": ("gauge", "1 while the feed's query runs, 0 once it stopped"),
    "fanout_feed_batches_total": ("counter", "micro-batches published"),
    "fanout_feed_records_total": ("counter", "records of published micro-batches by outcome"),
    "fanout_feed_reconnects_total": ("counter", "ingest connections re-made after a failure"),
    "fanout_feed_gateway_restarts_total": ("counter", "micro-batches that found a topic in a new epoch"),
    "fanout_feed_last_batch_id": ("gauge", "id of the last published micro-batch"),
    "fanout_feed_last_batch_rows": ("gauge", "records in the last micro-batch"),
    "fanout_feed_last_batch_timestamp_seconds": ("gauge", "unix time the last micro-batch was published"),
    "fanout_feed_publish_seconds": ("gauge", "seconds the last micro-batch took to publish"),
    "fanout_feed_event_time_lag_seconds": ("gauge", "now - newest event_time of the last micro-batch"),
    "fanout_feed_input_rows_per_second": ("gauge", "Spark: input rows per second (last progress)"),
    "fanout_feed_processed_rows_per_second": ("gauge", "Spark: processed rows per second (last progress)"),
    "fanout_feed_batch_duration_seconds": ("gauge", "Spark: duration of the last micro-batch"),
}
OUTCOMES = ("delivered", "lost", "already_present", "bad", "input_duplicate")


class FeedMetrics:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.values: dict[str, float] = {name: 0.0 for name in _HELP if name != "fanout_feed_records_total"}
        self.records = {outcome: 0 for outcome in OUTCOMES}
        self.values["fanout_feed_up"] = 1.0
        self._listener: StreamingQueryListener | None = None
        self._spark: SparkSession | None = None

    def batch(self, outcome: BatchOutcome, rows: int, event_lag: float | None, restarted: bool) -> None:
        with self._lock:
            v = self.values
            v["fanout_feed_batches_total"] += 1
            v["fanout_feed_reconnects_total"] += outcome.reconnects
            v["fanout_feed_gateway_restarts_total"] += int(restarted)
            v["fanout_feed_last_batch_id"] = outcome.batch
            v["fanout_feed_last_batch_rows"] = rows
            v["fanout_feed_last_batch_timestamp_seconds"] = time.time()
            v["fanout_feed_publish_seconds"] = outcome.seconds
            if event_lag is not None:
                v["fanout_feed_event_time_lag_seconds"] = event_lag
            self.records["delivered"] += outcome.delivered
            self.records["lost"] += outcome.lost_count
            self.records["already_present"] += outcome.already_present
            self.records["bad"] += outcome.bad_records
            self.records["input_duplicate"] += outcome.input_duplicates
        self.write()

    def progress(self, input_rps: float | None, processed_rps: float | None, duration_ms: float | None) -> None:
        with self._lock:
            if input_rps is not None:
                self.values["fanout_feed_input_rows_per_second"] = float(input_rps)
            if processed_rps is not None:
                self.values["fanout_feed_processed_rows_per_second"] = float(processed_rps)
            if duration_ms is not None:
                self.values["fanout_feed_batch_duration_seconds"] = duration_ms / 1000.0
        self.write()

    def text(self) -> str:
        lines = []
        with self._lock:
            for name, (kind, help_text) in _HELP.items():
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                if name == "fanout_feed_records_total":
                    lines.extend(f'{name}{{outcome="{o}"}} {n}' for o, n in self.records.items())
                else:
                    value = self.values[name]
                    lines.append(f"{name} {int(value) if float(value).is_integer() else repr(value)}")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if not self.path:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(self.path)}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(self.text())
        os.replace(tmp, self.path)

    # -- Spark's progress ----------------------------------------------------------------------------------
    def attach(self, spark: SparkSession, query_name: str) -> None:
        """Listen to the progress of the query named ``query_name`` (no-op without a path)."""
        if not self.path:
            return
        from pyspark.sql.streaming import StreamingQueryListener

        metrics = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event: QueryStartedEvent) -> None:
                pass

            def onQueryProgress(self, event: QueryProgressEvent) -> None:
                p = event.progress
                if p.name == query_name:
                    metrics.progress(p.inputRowsPerSecond, p.processedRowsPerSecond, p.batchDuration)

            def onQueryIdle(self, event: QueryIdleEvent) -> None:
                pass

            def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
                pass

        self._listener = Listener()
        self._spark = spark
        spark.streams.addListener(self._listener)
        self.write()

    def close(self) -> None:
        if self._listener is not None and self._spark is not None:
            try:
                self._spark.streams.removeListener(self._listener)
            except Exception:  # noqa: BLE001 - the session may be stopping
                pass
            self._listener = None
        with self._lock:
            self.values["fanout_feed_up"] = 0.0
        self.write()
