"""audit --follow: windowed fairness figures of live traffic, from the gateway's sampled delivery log
(gateway/ops/deliverylog.py, config ``[deliverylog]``), continuously.

Structured Streaming over the log's directory (JSON lines, one per message delivered to a sampled client;
the writer hides a file until it is complete). Event time is the delivery time (``deliver_ns``); with a
watermark of ``watermark_s`` seconds, deliveries are grouped into tumbling windows of ``window_s`` seconds
per (client, topic), and a window is finished once the watermark passes its end: its figures are computed
then, with the definitions of the batch audit (:mod:`pipeline.figures`, exact percentiles, on the driver:
the log is sampled), and appended to ``OUT/windows.jsonl``; ``OUT/latest.json`` holds the last window (for
a dashboard). Deliveries later than the watermark are dropped by Spark (counted in the query's progress).

Per window: deliveries, clients, topics; latency p50/p99/max over all deliveries and over the **cold topics**
(the quarter of the window's topics with the fewest messages, at least one topic: the ones a busy topic
could starve); skew p50/p99/max; starvation (largest excess of a pair's delivery gap over its topic's
publish gap) and the worst pairs; loss (missing / expected seqs, over pairs); Jain's index of the clients'
delivery rates. Deliveries whose publish time the gateway no longer had (``publish_ns`` null) count in
``unstamped`` and are left out of the figures.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipeline import figures, reference
from pipeline.errors import BadLog
from pipeline.feed import STOP_REQUESTED, _Gate

__all__ = ["LIVE_SCHEMA", "FollowStats", "follow", "window_figures"]

log = logging.getLogger(__name__)

LIVE_SCHEMA = T.StructType(
    [
        T.StructField("client", T.StringType()),
        T.StructField("transport", T.StringType()),
        T.StructField("topic", T.StringType()),
        T.StructField("seq", T.LongType()),
        T.StructField("publish_ns", T.LongType()),
        T.StructField("deliver_ns", T.LongType()),
        T.StructField("batch_id", T.LongType()),
    ]
)


@dataclass
class FollowStats:
    windows: int = 0
    rows: int = 0
    batches: int = 0
    #: (window end in ns, wall time the window's figures were written in ns) of each window
    written: list[tuple[int, int]] = field(default_factory=list)


def window_figures(start_ns: int, end_ns: int, rows: list[tuple]) -> dict:
    """The figures of one window from its rows ``(topic, seq, client, publish_ns, deliver_ns, batch_id)``."""
    stamped = [r for r in rows if r[3] is not None]
    facts = reference.facts(stamped)
    report = figures.build_report(**facts, exact=True)
    latencies = sorted(r[4] - r[3] for r in stamped)
    by_topic = facts["latency_by_topic"]
    messages = {t: len({r[1] for r in stamped if r[0] == t}) for t in by_topic}
    cold = sorted(messages, key=lambda t: (messages[t], t))[: max(1, len(messages) // 4)] if messages else []
    cold_latencies = sorted(r[4] - r[3] for r in stamped if r[0] in set(cold))

    def summary(values: list[int]) -> dict:
        return {
            "count": len(values),
            "p50": figures.percentile(values, 0.5),
            "p99": figures.percentile(values, 0.99),
            "max": values[-1] if values else None,
        }

    return {
        "window": {"start_ns": start_ns, "end_ns": end_ns},
        "rows": len(rows),
        "unstamped": len(rows) - len(stamped),
        "clients": report["clients"],
        "topics": report["topics"],
        "latency_ns": summary(latencies),
        "cold_topics": {"topics": cold, "latency_ns": summary(cold_latencies)},
        "skew_ns": {k: report["skew_ns"][k] for k in ("messages", "p50", "p99", "max")},
        "starvation": {"max_excess_ns": report["starvation"]["max_excess_ns"], "worst": report["starvation"]["worst"][:3]},
        "loss": {k: report["loss"][k] for k in ("expected", "missing", "rate", "pairs_with_loss")},
        "fairness": report["fairness"],
    }


def _write_json_line(path: Path, value: dict) -> None:
    with path.open("ab") as f:
        f.write(orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE))


def _write_latest(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(tmp, path)


def follow(
    spark: SparkSession,
    directory: str,
    out_dir: str,
    *,
    window_s: float = 60.0,
    watermark_s: float = 30.0,
    checkpoint: str | None = None,
    available_now: bool = False,
    trigger_seconds: float | None = None,
    max_seconds: float | None = None,
) -> FollowStats:
    """Run the live audit until ``max_seconds`` pass (or, ``available_now``, the files there are read)."""
    if "://" not in directory and not Path(directory).is_dir():
        raise BadLog(f"no delivery log directory {directory} (the gateway writes one with [deliverylog] enabled = true)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = FollowStats()
    temporary = checkpoint is None
    checkpoint = checkpoint or tempfile.mkdtemp(prefix="pipeline-follow-checkpoint-")
    events = (
        spark.readStream.schema(LIVE_SCHEMA).option("pathGlobFilter", "deliveries-*.jsonl").json(directory)
        .where(F.col("deliver_ns").isNotNull() & F.col("topic").isNotNull() & F.col("seq").isNotNull())
        .withColumn("deliver_ts", F.timestamp_micros(F.floor(F.col("deliver_ns") / 1000).cast("long")))
    )  # fmt: skip
    grouped = (
        events.withWatermark("deliver_ts", f"{int(watermark_s * 1000)} milliseconds")
        .groupBy(F.window("deliver_ts", f"{int(window_s * 1000)} milliseconds"), "client", "topic")
        .agg(F.collect_list(F.struct("seq", "publish_ns", "deliver_ns", "batch_id")).alias("d"))
    )

    gate = _Gate()

    def write_windows(df: DataFrame, batch_id: int) -> None:
        with gate.lock:
            if gate.stopping:
                raise RuntimeError(STOP_REQUESTED)
            _write_windows(df)

    def _write_windows(df: DataFrame) -> None:
        stats.batches += 1
        windows: dict[tuple[int, int], list[tuple]] = {}
        for row in df.collect():
            start = int(row["window"]["start"].timestamp() * 1e9)
            end = int(row["window"]["end"].timestamp() * 1e9)
            rows = windows.setdefault((start, end), [])
            for d in row["d"]:
                rows.append((row["topic"], d["seq"], row["client"], d["publish_ns"], d["deliver_ns"], d["batch_id"]))
        for (start, end), rows in sorted(windows.items()):
            result = window_figures(start, end, rows)
            _write_json_line(out / "windows.jsonl", result)
            _write_latest(out / "latest.json", result)
            stats.windows += 1
            stats.rows += len(rows)
            stats.written.append((end, time.time_ns()))
            log.info(
                "window %s: %d deliveries, loss rate %s, Jain %s",
                result["window"],
                len(rows),
                result["loss"]["rate"],
                result["fairness"]["jain"],
            )

    writer = (grouped.writeStream.queryName("pipeline-audit-follow").outputMode("append")
              .option("checkpointLocation", checkpoint).foreachBatch(write_windows))  # fmt: skip
    if available_now:
        writer = writer.trigger(availableNow=True)
    elif trigger_seconds is not None:
        writer = writer.trigger(processingTime=f"{trigger_seconds} seconds")
    query = writer.start()
    try:
        if max_seconds is None:
            query.awaitTermination()
        else:
            # seconds as a float are fine (pyspark waits int(timeout * 1000) ms); its annotation says int
            query.awaitTermination(max_seconds)  # type: ignore[arg-type]
    except StreamingQueryException as exc:
        if STOP_REQUESTED not in str(exc):
            raise
    finally:
        gate.close()  # between micro-batches, never in the middle of one
        if query.isActive:
            query.stop()
        if temporary:
            shutil.rmtree(checkpoint, ignore_errors=True)
    failure = query.exception()
    if failure is not None and STOP_REQUESTED not in str(failure):
        raise RuntimeError(f"audit --follow failed: {failure}")
    return stats
