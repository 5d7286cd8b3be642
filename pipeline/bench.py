"""Benchmarks of the pipeline: ``python -m pipeline.bench [audit|feed] ...``.

* ``audit`` (the default): generate an N-row delivery log (default 10 million rows; numpy + pyarrow, in
  chunks) and time the audit job on it. Prints generation and audit wall times.
* ``feed``: publish rate-micro-batch rows into a TCP ingest endpoint (``--host`` / ``--port``, a running
  gateway whose admin API, ``--admin-url`` with ``$GATEWAY_SERVER_ADMIN_TOKEN``, the feed reads) and print
  records/s. ``--in-process-gateway`` starts one with ``gateway.testing.run_gateway`` on the shipped config
  (``--reorder-window`` replaces its rules by one ring rule of that window and capacity 65,536).

Both print one JSON line of results at the end (for scripts), after a human-readable line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import figures, ingest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["generate_log", "main"]

LOG_SCHEMA = pa.schema(
    [(name, pa.string() if kind == "string" else pa.int64()) for name, kind in figures.DELIVERY_LOG_COLUMNS.items()]
)


def generate_log(path: Path, rows: int, *, clients: int = 100, topics: int = 10, loss: float = 0.001, seed: int = 1) -> int:
    """Write a synthetic delivery log of about ``rows`` rows (every client gets every topic; ``loss`` of the
    deliveries are missing) and return the row count written.

    Messages are published every ~100 us per topic; each client has its own median latency (0.2-2 ms,
    lognormal spread) so that the fairness figures are not trivial.
    """
    rng = np.random.default_rng(seed)
    messages = max(1, rows // clients)
    per_topic = -(-messages // topics)
    client_names = pa.array([f"client-{c:04d}" for c in range(clients)], pa.string())
    topic_names = pa.array([f"topic-{t:03d}" for t in range(topics)], pa.string())
    client_median_ns = rng.uniform(200_000, 2_000_000, clients)
    written = 0
    # One chunk = a block of seqs of every topic, delivered to every client: ~1M rows per row group.
    seqs_per_chunk = max(1, 1_000_000 // (clients * topics))
    with pq.ParquetWriter(path, LOG_SCHEMA) as writer:
        for start in range(0, per_topic, seqs_per_chunk):
            seq = np.arange(start, min(start + seqs_per_chunk, per_topic), dtype=np.int64)
            topic_idx = np.repeat(np.arange(topics), len(seq))
            seq_all = np.tile(seq, topics)
            publish = seq_all * 100_000 + topic_idx * 7_919 + rng.integers(0, 50_000, len(seq_all))
            n_msg = len(seq_all)
            client_idx = np.repeat(np.arange(clients), n_msg)
            latency = (client_median_ns[client_idx] * rng.lognormal(0.0, 0.5, n_msg * clients)).astype(np.int64)
            deliver = np.tile(publish, clients) + latency
            keep = rng.random(n_msg * clients) >= loss
            table = pa.table(
                {
                    "topic": pc.take(topic_names, np.tile(topic_idx, clients)[keep]),
                    "seq": np.tile(seq_all, clients)[keep],
                    "client": pc.take(client_names, client_idx[keep]),
                    "publish_ns": np.tile(publish, clients)[keep],
                    "deliver_ns": deliver[keep],
                    "batch_id": (deliver[keep] // 1_000_000),
                },
                schema=LOG_SCHEMA,
            )
            writer.write_table(table)
            written += table.num_rows
            if written >= rows:
                break
    return written


def _conf(pairs: list[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def _session(args: argparse.Namespace, name: str) -> tuple[SparkSession, bool]:
    """(the session, whether this call started it): a caller's running session is used and left running."""
    from pyspark.sql import SparkSession

    from pipeline.spark import get_session

    existing = SparkSession.getActiveSession()
    return existing or get_session(args.master, name, _conf(args.conf)), existing is None


def bench_audit(args: argparse.Namespace) -> dict:
    from pipeline.audit import audit

    work = Path(args.dir or tempfile.mkdtemp(prefix="pipeline-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "deliveries.parquet"
    started = time.perf_counter()
    rows = generate_log(log, args.rows, clients=args.clients, topics=args.topics)
    generated = time.perf_counter() - started
    spark, started_here = _session(args, "pipeline-bench-audit")
    try:
        started = time.perf_counter()
        report = audit(spark, str(log), str(work / "report"), exact=args.exact)
        audited = time.perf_counter() - started
        master = spark.sparkContext.master
    finally:
        if started_here:
            spark.stop()
    print(
        f"audit: {rows:,} rows ({log.stat().st_size / 1e6:.0f} MB Parquet, {args.clients} clients x {args.topics} "
        f"topics = {args.clients * args.topics:,} pairs) "
        f"generated in {generated:.1f} s, audited in {audited:.1f} s "
        f"({rows / audited:,.0f} rows/s, {report['percentiles']['method']} percentiles) on {master}"
    )
    return {"bench": "audit", "rows": rows, "generate_s": round(generated, 2), "audit_s": round(audited, 2),
            "master": master, "percentiles": report["percentiles"]["method"], "out": str(work)}  # fmt: skip


def bench_feed(args: argparse.Namespace) -> dict:
    import contextlib

    from pipeline.feed import FeedOptions, run_feed

    spark, started_here = _session(args, "pipeline-bench-feed")
    with contextlib.ExitStack() as stack:
        port, admin_url, admin_token = args.port, (None if args.no_admin else args.admin_url), None
        if args.in_process_gateway:
            from gateway.testing import run_gateway

            overrides = {}
            if args.reorder_window:
                rule = {"pattern": "*", "anonymous": True, "kind": "ring", "reorder_window": args.reorder_window,
                        "capacity": 65_536}  # fmt: skip
                overrides = {"topics": {"rules": [rule]}}
            gw = stack.enter_context(run_gateway(**overrides))
            port, admin_url, admin_token = gw.ingest_port, gw.http_url, gw.admin_token
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipeline-bench-feed-")))
        opts = FeedOptions(
            source=args.source, rows_per_batch=args.rows_per_batch if args.source == "rate" else None,
            topics=args.topics, num_partitions=args.num_partitions, path=str(work / "in"), max_files_per_trigger=1,
            by_topic=args.by_topic, lockstep=args.lockstep, chunk_size=args.chunk_size, host=args.host, port=port,
            admin_url=admin_url, admin_token=admin_token, available_now=True, checkpoint=str(work / "ck"),
        )  # fmt: skip
        batches = []
        try:
            for batch in range(args.batches):
                if args.source == "files":  # one JSON-lines file per micro-batch, moved in whole
                    _write_records(work, batch, args.rows_per_batch, args.topics)
                stats = run_feed(spark, opts)
                batches.append((stats.records, stats.seconds_in_batches, stats.lost))
        finally:
            if started_here:
                spark.stop()
    # The first batch pays for Python worker start-up: report the steady state from the others when there are.
    steady = batches[1:] or batches
    records = sum(b[0] for b in steady)
    seconds = sum(b[1] for b in steady)
    lost = sum(b[2] for b in batches)
    mode = "by-topic" if args.by_topic else "spread+lockstep" if args.lockstep else "spread"
    mode = f"{args.source}, {mode}"
    print(
        f"feed: {mode}, {args.num_partitions} partitions, chunk {args.chunk_size}: {records / seconds:,.0f} records/s "
        f"over {len(steady)} batches of {args.rows_per_batch:,} rows ({lost} lost in all)"
    )
    return {"bench": "feed", "mode": mode, "records_per_s": round(records / seconds), "lost": lost,
            "partitions": args.num_partitions, "chunk_size": args.chunk_size}  # fmt: skip


def _write_records(work: Path, batch: int, rows: int, topics: int) -> None:
    """File ``batch`` of the files benchmark: ``rows`` records, topics feed.files-<t>, seqs continuing."""
    import orjson

    (work / "in").mkdir(parents=True, exist_ok=True)
    staging = work / f"part-{batch}.json"
    start = batch * rows
    with staging.open("wb") as f:
        for value in range(start, start + rows):
            f.write(
                orjson.dumps(
                    {
                        "topic": f"feed.files-{value % topics}",
                        "seq": value // topics,
                        "data": orjson.dumps({"v": value}).decode(),
                    },
                    option=orjson.OPT_APPEND_NEWLINE,
                )
            )
    staging.rename(work / "in" / staging.name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench")
    audit = sub.add_parser("audit", help="audit wall time on a generated delivery log (default)")
    feed = sub.add_parser("feed", help="feed records/s into a TCP ingest endpoint")
    for p in (parser, audit, feed):
        p.add_argument("--master", help="Spark master (default: local[*])")
        p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    for p in (parser, audit):
        p.add_argument("--rows", type=int, default=10_000_000, help="delivery log rows (default 10,000,000)")
        p.add_argument("--clients", type=int, default=100)
        p.add_argument("--topics", type=int, default=10)
        p.add_argument("--exact", action="store_true", help="exact percentiles (slow on large logs)")
        p.add_argument("--dir", help="where to write the log and the report (default: a temporary directory)")
    feed.add_argument("--host", default="127.0.0.1")
    feed.add_argument("--port", type=int, default=ingest.DEFAULT_PORT)
    feed.add_argument("--admin-url", default="http://127.0.0.1:8080", help="the gateway's admin API (topic settings)")
    feed.add_argument("--no-admin", action="store_true", help="do not read topic settings")
    feed.add_argument("--in-process-gateway", action="store_true", help="start gateway.testing.run_gateway")
    feed.add_argument("--reorder-window", type=int, help="with --in-process-gateway: reorder_window of every topic")
    feed.add_argument(
        "--source",
        choices=("rate", "files"),
        default="rate",
        help="rate-micro-batch, or one JSON-lines file per micro-batch (written before each run)",
    )
    feed.add_argument("--rows-per-batch", type=int, default=100_000)
    feed.add_argument("--batches", type=int, default=4)
    feed.add_argument("--topics", type=int, default=4)
    feed.add_argument("--num-partitions", type=int, default=2)
    feed.add_argument("--chunk-size", type=int, default=ingest.DEFAULT_CHUNK_SIZE)
    feed.add_argument("--by-topic", action="store_true")
    feed.add_argument("--lockstep", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = bench_feed(args) if args.bench == "feed" else bench_audit(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
