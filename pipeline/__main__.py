"""Console entry point: ``python -m pipeline {feed,audit} ...`` (also installed as ``fanout-pipeline``)."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from pipeline import figures, ingest

__all__ = ["build_parser", "main"]


def _spark_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master",
        help="Spark master URL, e.g. local[2], spark://host:7077, yarn (default: spark-submit's, else local[*])",
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark setting, repeatable (e.g. --conf spark.driver.memory=4g)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every micro-batch")
    sub = parser.add_subparsers(dest="command", required=True)

    feed = sub.add_parser("feed", help="stream files or the rate source into the gateway's TCP ingest")
    _spark_options(feed)
    src = feed.add_argument_group("source")
    src.add_argument("--source", choices=("files", "rate"), default="rate")
    src.add_argument("--path", help="directory of record files (--source files)")
    src.add_argument("--format", choices=("json", "csv", "parquet"), default="json", help="file format (json: JSON lines)")
    src.add_argument("--max-files-per-trigger", type=int, help="files per micro-batch (--source files)")
    src.add_argument(
        "--rows-per-batch",
        type=int,
        help="rate: use the deterministic rate-micro-batch source with this many rows per micro-batch",
    )
    src.add_argument("--rows-per-second", type=int, default=1000, help="rate without --rows-per-batch (default 1000)")
    src.add_argument("--start-timestamp-ms", type=int, default=0, help="rate-micro-batch: event time of row 0")
    src.add_argument("--topics", type=int, default=4, help="rate: number of topics (default 4)")
    src.add_argument("--topic-prefix", default="rate-", help="rate: topic name prefix (default rate-)")
    sink = feed.add_argument_group("sink")
    sink.add_argument("--host", default="127.0.0.1", help="gateway TCP ingest host (default 127.0.0.1)")
    sink.add_argument("--port", type=int, default=ingest.DEFAULT_PORT, help="gateway TCP ingest port (default 7002)")
    sink.add_argument("--num-partitions", type=int, default=2, help="publishing partitions = connections (default 2)")
    sink.add_argument(
        "--by-topic",
        action="store_true",
        help="one producer per topic (repartition by topic); default: spread every topic over all partitions",
    )
    sink.add_argument(
        "--lockstep",
        action="store_true",
        help="spread mode: partitions publish one synced chunk per round (barrier stage), bounding reordering "
        "to chunk size x partitions; needs a task slot per partition",
    )
    sink.add_argument("--chunk-size", type=int, default=ingest.DEFAULT_CHUNK_SIZE, help="lines per write (default 500)")
    sink.add_argument(
        "--timeout", type=float, default=ingest.DEFAULT_TIMEOUT, help="seconds to wait for the gateway (default 30)"
    )
    run = feed.add_argument_group("query")
    run.add_argument("--checkpoint", help="checkpoint directory (default: a temporary one, no recovery)")
    run.add_argument("--available-now", action="store_true", help="process what is available, then stop")
    run.add_argument("--trigger-seconds", type=float, help="micro-batch interval (default: as fast as possible)")
    run.add_argument("--max-seconds", type=float, help="stop the query after this many seconds")

    audit = sub.add_parser("audit", help="delivery log (Parquet) -> fairness report")
    _spark_options(audit)
    audit.add_argument("log", help="delivery log: Parquet file or directory")
    audit.add_argument("out", help="output directory (report.json and Parquet tables)")
    audit.add_argument("--exact", action="store_true", help="exact percentiles (small logs); default approximate")
    audit.add_argument(
        "--accuracy",
        type=int,
        default=figures.DEFAULT_ACCURACY,
        help=f"percentile_approx accuracy (default {figures.DEFAULT_ACCURACY}: rank error <= n/{figures.DEFAULT_ACCURACY})",
    )
    return parser


def _conf(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--conf wants KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def failure_summary(exc: BaseException) -> str:
    """The line that says what went wrong, out of a streaming query's many-layered exception: the last
    exception line raised by our own code (the gateway's refusal, a timeout, bad data), else the first line."""
    text = str(exc)
    ours = re.findall(r"^(?:(?:pipeline|gateway)\.[\w.]+|ValueError|OSError|ConnectionRefusedError|\w*Error): .+$",
                      text, re.M)
    return ours[-1] if ours else text.splitlines()[0] if text else type(exc).__name__


def _session(args: argparse.Namespace, app_name: str):
    """(whether this call started the session, the session): a caller's running session (tests, a load
    tester calling :func:`main`) is used as is and left running."""
    from pyspark.sql import SparkSession

    from pipeline.spark import get_session

    existing = SparkSession.getActiveSession()
    return existing is None, existing or get_session(args.master, app_name, _conf(args.conf))


def _feed(args: argparse.Namespace) -> int:
    from pipeline.feed import FeedOptions, run_feed

    opts = FeedOptions(
        source=args.source,
        path=args.path,
        format=args.format,
        max_files_per_trigger=args.max_files_per_trigger,
        rows_per_batch=args.rows_per_batch,
        rows_per_second=args.rows_per_second,
        start_timestamp_ms=args.start_timestamp_ms,
        topics=args.topics,
        topic_prefix=args.topic_prefix,
        num_partitions=args.num_partitions,
        by_topic=args.by_topic,
        lockstep=args.lockstep,
        host=args.host,
        port=args.port,
        chunk_size=args.chunk_size,
        timeout=args.timeout,
        checkpoint=args.checkpoint,
        available_now=args.available_now,
        trigger_seconds=args.trigger_seconds,
        max_seconds=args.max_seconds,
    )
    try:
        opts.check()
    except ValueError as exc:
        print(f"feed: {exc}", file=sys.stderr)
        return 2
    started_here, spark = _session(args, "pipeline-feed")
    try:
        stats = run_feed(spark, opts)
    except Exception as exc:  # the query's failure: Spark wraps the task's error in a few layers
        if args.verbose:
            print(f"feed: failed: {exc}", file=sys.stderr)
        print(f"feed: failed: {failure_summary(exc)}", file=sys.stderr)
        return 1
    finally:
        if started_here:
            spark.stop()
    rate = stats.records / stats.seconds_in_batches if stats.seconds_in_batches else 0.0
    print(
        f"feed: {stats.batches} batches, {stats.records} records, {stats.accepted} accepted, "
        f"{stats.duplicates} duplicate_seq, {stats.stale} stale_seq, {rate:,.0f} records/s while publishing"
    )
    return 0


def _audit(args: argparse.Namespace) -> int:
    from pipeline.audit import audit

    started_here, spark = _session(args, "pipeline-audit")
    try:
        report = audit(spark, args.log, args.out, exact=args.exact, accuracy=args.accuracy)
    finally:
        if started_here:
            spark.stop()
    loss = report["loss"]["rate"]
    jain = report["fairness"]["jain"]
    print(
        f"audit: {report['rows']} deliveries, {report['topics']} topics, {report['clients']} clients; "
        f"loss rate {loss if loss is None else f'{loss:.6f}'}, Jain {jain if jain is None else f'{jain:.4f}'}; "
        f"report in {args.out}/report.json"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # py4j logs every callback at INFO, and a failed foreachBatch once more at ERROR, which the feed's own
    # failure line already says.
    logging.getLogger("py4j").setLevel(logging.WARNING if args.verbose else logging.CRITICAL)
    return _feed(args) if args.command == "feed" else _audit(args)


if __name__ == "__main__":
    sys.exit(main())
