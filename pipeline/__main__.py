"""Console entry point: ``python -m pipeline {feed,audit} ...`` (also installed as ``fanout-pipeline``)."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import TYPE_CHECKING

from pipeline import figures, ingest
from pipeline.errors import one_line
from pipeline.gatewayapi import DEFAULT_ADMIN_URL, TOKEN_VARIABLE
from pipeline.retry import DEFAULT_RETRY, RetryPolicy

if TYPE_CHECKING:  # both import Spark: loaded by the commands that run it
    from pyspark.sql import SparkSession

    from pipeline.feed import FeedOptions, FeedStats

__all__ = ["build_parser", "main"]


def _verbose(parser: argparse.ArgumentParser, top: bool) -> None:
    # accepted before and after the subcommand; a subcommand's flag must not reset the top-level one
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="log every micro-batch and print the traceback of a failure",
    )


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
    _verbose(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    feed = sub.add_parser("feed", help="stream files or the rate source into the gateway's TCP ingest")
    _verbose(feed, top=False)
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
    src.add_argument(
        "--topic-prefix", default="feed.rate-", help="rate: topic name prefix (default feed.rate-: the shipped feed.* rule)"
    )
    src.add_argument(
        "--bad-records",
        metavar="DIR",
        help="files: write malformed records (file, line, reason) to DIR/batch-N.jsonl and go on "
        "(default: the first one fails the feed)",
    )
    src.add_argument(
        "--max-bad-records",
        type=int,
        default=1000,
        help="with --bad-records: more bad records than this in one micro-batch still fails it (1000)",
    )
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
    sink.add_argument(
        "--sync-every",
        type=int,
        default=ingest.DEFAULT_SYNC_EVERY,
        help=f"records between two syncs of a connection (default {ingest.DEFAULT_SYNC_EVERY:,})",
    )
    sink.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRY.attempts,
        help=f"reconnect attempts while the gateway is down (default {DEFAULT_RETRY.attempts})",
    )
    sink.add_argument(
        "--backoff",
        type=float,
        default=DEFAULT_RETRY.initial,
        help=f"first wait before reconnecting, doubled each time (default {DEFAULT_RETRY.initial} s)",
    )
    sink.add_argument(
        "--backoff-max",
        type=float,
        default=DEFAULT_RETRY.maximum,
        help=f"longest wait between attempts (default {DEFAULT_RETRY.maximum} s)",
    )
    admin = feed.add_argument_group("gateway admin API (topic settings, epochs)")
    admin.add_argument("--admin-url", default=DEFAULT_ADMIN_URL, help=f"default {DEFAULT_ADMIN_URL}")
    admin.add_argument("--admin-token", help=f"bearer token (default: ${TOKEN_VARIABLE})")
    admin.add_argument(
        "--no-admin",
        action="store_true",
        help="do not read topic settings: no plan check, and only skipped_seq answers count as loss",
    )
    run = feed.add_argument_group("query")
    run.add_argument("--checkpoint", help="checkpoint directory (default: a temporary one, no recovery)")
    run.add_argument("--available-now", action="store_true", help="process what is available, then stop")
    run.add_argument("--trigger-seconds", type=float, help="micro-batch interval (default: as fast as possible)")
    run.add_argument("--max-seconds", type=float, help="stop the query after this many seconds")
    run.add_argument(
        "--allow-loss", action="store_true", help="commit micro-batches that lost records (still reported) instead of failing"
    )
    run.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="write the query's metrics to PATH (Prometheus text format) after every micro-batch",
    )

    audit = sub.add_parser("audit", help="delivery log (Parquet) -> fairness report")
    _verbose(audit, top=False)
    _spark_options(audit)
    audit.add_argument("log", help="delivery log: Parquet file or directory (--follow: the gateway's [deliverylog] directory)")
    audit.add_argument("out", help="output directory (report.json and Parquet tables; --follow: windows.jsonl, latest.json)")
    live = audit.add_argument_group("live audit of the gateway's sampled delivery log")
    live.add_argument(
        "--follow", action="store_true", help="Structured Streaming over the directory: windowed figures as windows finish"
    )
    live.add_argument("--window", type=float, default=60.0, help="window length in seconds (default 60)")
    live.add_argument(
        "--watermark", type=float, default=30.0, help="how late (s) a delivery may be logged and still count (default 30)"
    )
    live.add_argument("--checkpoint", help="checkpoint directory (default: a temporary one)")
    live.add_argument("--max-seconds", type=float, help="stop after this many seconds")
    live.add_argument("--available-now", action="store_true", help="read what is there, then stop")
    live.add_argument("--trigger-seconds", type=float, help="micro-batch interval (default: as fast as possible)")
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
    """The line that says what went wrong (:func:`pipeline.errors.one_line`)."""
    return one_line(exc)


#: what the `pipeline` extra (pyproject.toml) brings: a plain install of the wheel has neither
EXTRA_MODULES = frozenset({"pyspark", "py4j", "pyarrow"})
#: exit status of a command whose extra is not installed (as a usage error: nothing ran)
EXIT_MISSING_EXTRA = 2


def _missing_extra(command: str, exc: ModuleNotFoundError) -> int:
    module = (exc.name or "").partition(".")[0]
    print(
        f"{command}: fanout-pipeline needs {module}, which the pipeline extra installs: pip install "
        "'fanout-gateway[pipeline]' (and Java 17+ for Spark; in a checkout, `make setup` installs every extra)",
        file=sys.stderr,
    )
    return EXIT_MISSING_EXTRA


def _fail(command: str, exc: BaseException, verbose: bool) -> int:
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{command}: {one_line(exc)}", file=sys.stderr)
    return 1


def _session(args: argparse.Namespace, app_name: str) -> tuple[bool, SparkSession]:
    """(whether this call started the session, the session): a caller's running session (tests, a load
    tester calling :func:`main`) is used as is and left running."""
    from pyspark.sql import SparkSession

    from pipeline.spark import get_session

    existing = SparkSession.getActiveSession()
    return existing is None, existing or get_session(args.master, app_name, _conf(args.conf))


def _feed(args: argparse.Namespace) -> int:
    from pipeline.feed import FeedOptions, preflight, run_feed

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
        admin_url=None if args.no_admin else args.admin_url,
        admin_token=args.admin_token,
        allow_loss=args.allow_loss,
        sync_every=args.sync_every,
        bad_records=args.bad_records,
        max_bad_records=args.max_bad_records,
        metrics_file=args.metrics_file,
    )
    try:
        opts = _with_retry(opts, args)
        opts.check()
    except ValueError as exc:
        print(f"feed: {exc}", file=sys.stderr)
        return 2

    try:
        preflight(opts)  # before the JVM starts: a plan that cannot work, a gateway that is not there
    except Exception as exc:
        return _fail("feed", exc, args.verbose)
    started_here, spark = _session(args, "pipeline-feed")
    try:
        stats = run_feed(spark, opts)
    except Exception as exc:  # the query's failure: Spark wraps the task's error in a few layers
        so_far: FeedStats | None = getattr(exc, "stats", None)
        if so_far is not None and so_far.batches:
            print(f"feed: {so_far.summary()}", file=sys.stderr)
        return _fail("feed", exc, args.verbose)
    finally:
        if started_here:
            spark.stop()
    print(f"feed: {stats.summary()}")
    return 1 if stats.lost and not opts.allow_loss else 0


def _with_retry(opts: FeedOptions, args: argparse.Namespace) -> FeedOptions:
    from dataclasses import replace

    return replace(opts, retry=RetryPolicy(args.retries, args.backoff, max(args.backoff, args.backoff_max)))


def _follow(args: argparse.Namespace) -> int:
    from pipeline.live import follow

    started_here, spark = _session(args, "pipeline-audit-follow")
    try:
        stats = follow(spark, args.log, args.out, window_s=args.window, watermark_s=args.watermark,
                       checkpoint=args.checkpoint, available_now=args.available_now,
                       trigger_seconds=args.trigger_seconds, max_seconds=args.max_seconds)  # fmt: skip
    except Exception as exc:
        return _fail("audit", exc, args.verbose)
    finally:
        if started_here:
            spark.stop()
    print(
        f"audit: {stats.windows} windows of {args.window:g} s finished ({stats.rows} deliveries); figures in "
        f"{args.out}/windows.jsonl, the last in {args.out}/latest.json"
    )
    return 0


def _audit(args: argparse.Namespace) -> int:
    from pipeline.audit import audit

    if args.follow:
        return _follow(args)
    started_here, spark = _session(args, "pipeline-audit")
    try:
        report = audit(spark, args.log, args.out, exact=args.exact, accuracy=args.accuracy)
    except Exception as exc:
        return _fail("audit", exc, args.verbose)
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
    try:
        return _feed(args) if args.command == "feed" else _audit(args)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in EXTRA_MODULES:
            return _fail(args.command, exc, args.verbose)
        return _missing_extra(args.command, exc)
    except Exception as exc:  # starting Spark (no Java, a bad --conf or --master), and anything unforeseen
        return _fail(args.command, exc, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
