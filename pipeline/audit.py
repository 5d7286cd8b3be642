"""audit: a load tester's delivery log (Parquet) -> fairness report (Parquet tables + report.json).

The heavy lifting is Spark's: percentiles per topic over every delivery, a group by message for the skew
and the publish times, and a window over each (client, topic) pair ordered by delivery time for the largest
gap. The pair and client tables stay in Spark and are written from there; what comes back to the driver is
one row per topic, the totals and the worst pairs, turned into the report by
:func:`pipeline.figures.report_from_parts`, the same code the pure-Python reference ends in.

Output directory::

    report.json            the report (see pipeline/figures.py for every definition)
    latency_by_topic/      topic, count, p50, p90, p99, max (ns)
    skew_by_topic/         topic, messages, p50, p99, max (ns)
    pairs/                 one row per (client, topic): loss and starvation facts
    clients/               one row per client: deliveries, span, rate

``report.json`` is written with plain file I/O, so the output directory must be on the driver's file system;
the tables go through Spark and may be anywhere Spark writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, overload

import orjson
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F

from pipeline import figures
from pipeline.errors import BadLog
from pipeline.figures import PairFacts

__all__ = ["audit"]

_PAIRS_SCHEMA = (
    "client string, topic string, deliveries long, distinct_seqs long, first_seq long, last_seq long, "
    "first_deliver_ns long, last_deliver_ns long, max_deliver_gap_ns long, max_publish_gap_ns long, "
    "expected long, missing long, loss_rate double, excess_ns long"
)
_CLIENTS_SCHEMA = "client string, deliveries long, first_deliver_ns long, last_deliver_ns long, span_ns long, rate_per_s double"
_PAIR_COLUMNS = [c.split()[0] for c in _PAIRS_SCHEMA.split(", ")]
_CLIENT_COLUMNS = [c.split()[0] for c in _CLIENTS_SCHEMA.split(", ")]
_LATENCY_SCHEMA = "topic string, count long, p50 double, p90 double, p99 double, max long"
_SKEW_SCHEMA = "topic string, messages long, p50 double, p99 double, max long"


def _percentiles(column: Column, ps: tuple[float, ...], exact: bool, accuracy: int) -> Column:
    if exact:
        return F.percentile(column, list(ps))
    return F.percentile_approx(column, list(ps), accuracy)


#: one summary: ``{count_key: n (int), "p50": float, ..., "max": int}`` (None where there were no values)
Summary = dict[str, Any]


@overload
def _summaries(
    df: DataFrame, value: str, ps: tuple[float, ...], count_key: str, exact: bool, accuracy: int, *, total: Literal[False] = False
) -> dict[str, Summary]: ...


@overload
def _summaries(
    df: DataFrame, value: str, ps: tuple[float, ...], count_key: str, exact: bool, accuracy: int, *, total: Literal[True]
) -> tuple[dict[str, Summary], Summary]: ...


def _summaries(
    df: DataFrame, value: str, ps: tuple[float, ...], count_key: str, exact: bool, accuracy: int, *, total: bool = False
) -> dict[str, Summary] | tuple[dict[str, Summary], Summary]:
    """Per-topic summaries ``{topic: {count_key, p.., max}}`` of column ``value``, and with ``total`` also the
    summary over all topics (one pass: ``rollup``)."""
    aggs = [
        F.count(F.lit(1)).alias("n"),
        F.max(value).alias("max"),
        _percentiles(F.col(value), ps, exact, accuracy).alias("ps"),
    ]
    grouped = df.rollup("topic").agg(F.grouping("topic").alias("all"), *aggs) if total else df.groupBy("topic").agg(*aggs)
    by_topic: dict[str, Summary] = {}
    overall: Summary = {count_key: 0, **{f"p{round(p * 100)}": None for p in ps}, "max": None}
    for row in grouped.collect():
        summary: Summary = {count_key: row["n"]}
        for p, v in zip(ps, row["ps"] or [None] * len(ps)):
            summary[f"p{round(p * 100)}"] = None if v is None else float(v)
        summary["max"] = row["max"]
        if total and row["all"]:
            if row["n"]:
                overall = summary
        else:
            by_topic[row["topic"]] = summary
    return (by_topic, overall) if total else by_topic


_SPARK_TYPES = {"string": ("string",), "int64": ("bigint", "int", "smallint", "tinyint")}


def read_log(spark: SparkSession, log_path: str) -> DataFrame:
    """The delivery log's columns, or :class:`BadLog` naming the path, the missing column or the wrong type."""
    from pyspark.errors import AnalysisException

    try:
        log = spark.read.parquet(log_path)
    except AnalysisException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "PATH_NOT_FOUND" in first or "does not exist" in first:
            raise BadLog(f"no delivery log at {log_path}") from None
        raise BadLog(f"cannot read the delivery log {log_path} as Parquet: {first[:300]}") from None
    types = dict(log.dtypes)
    for column, kind in figures.DELIVERY_LOG_COLUMNS.items():
        if column not in types:
            raise BadLog(
                f"delivery log {log_path} has no column {column!r} ({kind}); its columns: "
                f"{', '.join(f'{c} {t}' for c, t in log.dtypes)}"
            )
        if types[column] not in _SPARK_TYPES[kind]:
            raise BadLog(f"delivery log {log_path}: column {column!r} is {types[column]}, not {kind}")
    return log.select(*(F.col(c).cast("string" if k == "string" else "long") for c, k in figures.DELIVERY_LOG_COLUMNS.items()))


def _largest_gap(ordered_by: str, partition: list[str]) -> Column:
    previous = F.lag(ordered_by).over(Window.partitionBy(*partition).orderBy(ordered_by))
    return F.col(ordered_by) - previous


def audit(
    spark: SparkSession,
    log_path: str,
    out_dir: str,
    *,
    exact: bool = False,
    accuracy: int = figures.DEFAULT_ACCURACY,
) -> dict:
    """Compute the report of the delivery log at ``log_path``, write it and the tables to ``out_dir``."""
    log = read_log(spark, log_path)
    latency = (F.col("deliver_ns") - F.col("publish_ns")).alias("latency_ns")
    deliveries = log.select("topic", "seq", "client", "deliver_ns", latency, "publish_ns")

    latency_by_topic = _summaries(deliveries, "latency_ns", figures.LATENCY_PERCENTILES, "count", exact, accuracy)

    messages = (
        log.groupBy("topic", "seq")
        .agg(
            F.min("publish_ns").alias("publish_ns"),
            (F.max("deliver_ns") - F.min("deliver_ns")).alias("skew_ns"),
            F.count(F.lit(1)).alias("deliveries"),
        )
        .cache()
    )
    try:
        multi = messages.where(F.col("deliveries") >= 2)
        skew_by_topic, skew = _summaries(multi, "skew_ns", figures.SKEW_PERCENTILES, "messages", exact, accuracy, total=True)
        publish_gaps = (
            messages.select("topic", _largest_gap("publish_ns", ["topic"]).alias("gap"))
            .groupBy("topic")
            .agg(F.coalesce(F.max("gap"), F.lit(0)).alias("max_publish_gap_ns"))
        )
        # Two windows over the same (client, topic) partitioning, so one shuffle: ordered by seq to count
        # distinct seqs (cheaper than count_distinct's expand), ordered by delivery time for the gaps.
        new_seq = F.col("seq") != F.lag("seq").over(Window.partitionBy("client", "topic").orderBy("seq"))
        pairs = (
            log.select("client", "topic", "seq", "deliver_ns", F.coalesce(new_seq.cast("long"), F.lit(1)).alias("new_seq"))
            .select("*", _largest_gap("deliver_ns", ["client", "topic"]).alias("gap"))
            .groupBy("client", "topic")
            .agg(
                F.count(F.lit(1)).alias("deliveries"),
                F.sum("new_seq").alias("distinct_seqs"),
                F.min("seq").alias("first_seq"),
                F.max("seq").alias("last_seq"),
                F.min("deliver_ns").alias("first_deliver_ns"),
                F.max("deliver_ns").alias("last_deliver_ns"),
                F.coalesce(F.max("gap"), F.lit(0)).alias("max_deliver_gap_ns"),
            )
            .join(publish_gaps, "topic")
        )
        expected = F.col("last_seq") - F.col("first_seq") + 1
        pairs = (
            pairs.withColumn("expected", expected)
            .withColumn("missing", expected - F.col("distinct_seqs"))
            .withColumn("loss_rate", (expected - F.col("distinct_seqs")) / expected)
            .withColumn("excess_ns", F.col("max_deliver_gap_ns") - F.col("max_publish_gap_ns"))
            .select(*_PAIR_COLUMNS)
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        try:
            parts = _pair_parts(pairs, out_dir)
        finally:
            pairs.unpersist()
    finally:
        messages.unpersist()

    rows = sum(summary["count"] for summary in latency_by_topic.values())
    report = figures.report_from_parts(
        rows=rows, latency_by_topic=latency_by_topic, skew=skew, skew_by_topic=skew_by_topic, exact=exact,
        accuracy=accuracy, **parts,
    )  # fmt: skip
    _write_topic_tables(spark, out_dir, latency_by_topic, skew_by_topic)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    return report


def _facts(row: Row) -> PairFacts:
    return PairFacts(**{name: row[name] for name in PairFacts.__slots__})


def _pair_parts(pairs: DataFrame, out_dir: str) -> dict:
    """Write the pair and client tables from Spark; collect the totals and the worst pairs only."""
    pairs.write.mode("overwrite").parquet(os.path.join(out_dir, "pairs"))
    span = F.col("last_deliver_ns") - F.col("first_deliver_ns")
    clients = (
        pairs.groupBy("client")
        .agg(F.sum("deliveries").alias("deliveries"), F.min("first_deliver_ns").alias("first_deliver_ns"),
             F.max("last_deliver_ns").alias("last_deliver_ns"))
        .withColumn("span_ns", span)
        .withColumn("rate_per_s", F.when((F.col("deliveries") >= 2) & (span > 0),
                                         F.col("deliveries") / (span / F.lit(1e9))))
        .select(*_CLIENT_COLUMNS)
    )  # fmt: skip
    clients.write.mode("overwrite").parquet(os.path.join(out_dir, "clients"))
    written = pairs.sparkSession.read.parquet(os.path.join(out_dir, "clients"))
    rate = F.col("rate_per_s")
    c = written.agg(
        F.count(F.lit(1)).alias("clients"),
        F.count(rate).alias("n"),
        F.sum(rate).alias("s1"),
        F.sum(rate * rate).alias("s2"),
        F.min(rate).alias("min"),
        F.max(rate).alias("max"),
    ).collect()[0]
    p = pairs.agg(F.count(F.lit(1)).alias("pairs"), F.sum("expected").alias("expected"), F.sum("missing").alias("missing"),
                  F.sum(F.when(F.col("missing") > 0, 1).otherwise(0)).alias("with_loss")).collect()[0]  # fmt: skip
    worst_excess = pairs.orderBy(F.desc("excess_ns"), "client", "topic").limit(figures.WORST).collect()
    worst_loss = (pairs.where(F.col("missing") > 0).orderBy(F.desc("loss_rate"), "client", "topic")
                  .limit(figures.WORST).collect())  # fmt: skip
    return {
        "pairs": p["pairs"], "expected": p["expected"] or 0, "missing": p["missing"] or 0,
        "pairs_with_loss": p["with_loss"] or 0, "worst_excess": [_facts(r) for r in worst_excess],
        "worst_loss": [_facts(r) for r in worst_loss], "clients": c["clients"],
        "rates": {"n": c["n"], "jain": figures.jain_of_sums(c["n"], c["s1"], c["s2"]), "min": c["min"], "max": c["max"]},
    }  # fmt: skip


def _write_topic_tables(spark: SparkSession, out_dir: str, latency_by_topic: dict, skew_by_topic: dict) -> None:
    def write(name: str, rows: list[tuple], schema: str) -> None:
        spark.createDataFrame(rows, schema).coalesce(1).write.mode("overwrite").parquet(os.path.join(out_dir, name))

    write(
        "latency_by_topic",
        [(t, s["count"], s["p50"], s["p90"], s["p99"], s["max"]) for t, s in sorted(latency_by_topic.items())],
        _LATENCY_SCHEMA,
    )
    write(
        "skew_by_topic",
        [(t, s["messages"], s["p50"], s["p99"], s["max"]) for t, s in sorted(skew_by_topic.items())],
        _SKEW_SCHEMA,
    )
