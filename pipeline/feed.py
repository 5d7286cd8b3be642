"""feed: Structured Streaming from files or the rate source into the gateway's TCP ingest.

Every micro-batch goes through ``foreachBatch``: the batch is repartitioned (``--by-topic``: by topic, so
each topic has one producer; spread, the default: by ``seq mod n``, so every partition publishes every
topic), sorted by seq within each partition, and each partition is published over its own ingest connection
by :func:`pipeline.ingest.publish` in ``foreachPartition`` (chunks of lines, then ``{"sync": id}``; the Spark
task fails unless the gateway's ``synced`` answer arrives and every record was accepted or answered
``duplicate_seq`` / ``stale_seq``). ``--lockstep`` (spread only) publishes in rounds of one synced chunk per
partition instead (:mod:`pipeline.lockstep`), which bounds the gateway's reordering to chunk x partitions.

A failed task fails the batch and the query; restarted on the same ``--checkpoint``, Spark runs the batch
again and records with explicit seqs that already landed are refused as duplicate/stale, so nothing is
published twice. Records without a seq get the gateway's next seq: a retried batch publishes them again
(not idempotent). See docs/pipeline.md.
"""

from __future__ import annotations

import functools
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from pyspark import BarrierTaskContext, TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipeline import ingest
from pipeline.lockstep import RoundClient, RoundCoordinator

__all__ = [
    "FEED_SCHEMA",
    "FeedOptions",
    "FeedStats",
    "build_source",
    "prepare_batch",
    "publish_batch",
    "run_feed",
    "send_partition",
    "send_partition_lockstep",
]

log = logging.getLogger(__name__)

#: Records read from files. ``data`` is a string holding one JSON value (any JSON: object, array, number...),
#: published as that value; ``seq`` is optional (null: the gateway assigns one); ``event_time`` is optional
#: and not published (it documents when the record was made; the rate demo fills it).
FEED_SCHEMA = T.StructType(
    [
        T.StructField("topic", T.StringType(), nullable=False),
        T.StructField("data", T.StringType(), nullable=True),
        T.StructField("seq", T.LongType(), nullable=True),
        T.StructField("event_time", T.TimestampType(), nullable=True),
    ]
)

FORMATS = ("json", "csv", "parquet")


@dataclass(frozen=True)
class FeedOptions:
    source: str = "rate"  # "files" or "rate"
    path: str | None = None
    format: str = "json"
    max_files_per_trigger: int | None = None
    #: rate: with rows_per_batch, the deterministic ``rate-micro-batch`` source; else ``rate`` by wall time.
    rows_per_batch: int | None = None
    rows_per_second: int = 1000
    start_timestamp_ms: int = 0
    topics: int = 4
    topic_prefix: str = "rate-"
    num_partitions: int = 2
    by_topic: bool = False
    #: spread mode only: partitions publish in rounds of one chunk each, a round starting when every partition's
    #: previous chunk is synced (Spark barrier execution), which bounds the reordering to chunk x partitions.
    lockstep: bool = False
    host: str = "127.0.0.1"
    port: int = ingest.DEFAULT_PORT
    chunk_size: int = ingest.DEFAULT_CHUNK_SIZE
    timeout: float = ingest.DEFAULT_TIMEOUT
    checkpoint: str | None = None
    available_now: bool = False
    trigger_seconds: float | None = None
    max_seconds: float | None = None

    def check(self) -> None:
        """Raise ``ValueError`` for a combination that cannot work."""
        if self.source not in ("files", "rate"):
            raise ValueError(f"unknown source {self.source!r}")
        if self.source == "files" and not self.path:
            raise ValueError("--source files needs --path")
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}")
        if self.source == "rate" and self.available_now and self.rows_per_batch is None:
            # Plain `rate` measures elapsed time from the query start: an availableNow run sees 0 rows.
            raise ValueError("--available-now with --source rate needs --rows-per-batch (rate-micro-batch)")
        if self.available_now and self.trigger_seconds is not None:
            raise ValueError("--available-now and --trigger-seconds are exclusive")
        if self.lockstep and self.by_topic:
            raise ValueError("--lockstep is for spread mode; --by-topic never reorders")
        for name in ("topics", "num_partitions", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class FeedStats:
    """What the query published, summed over batches on the driver (``foreachBatch`` runs there)."""

    batches: int = 0
    records: int = 0
    accepted: int = 0
    #: refused as ``duplicate_seq`` (already there: a replayed batch)
    duplicates: int = 0
    #: refused as ``stale_seq``: a replayed batch, or a hole the gateway gave up (reorder window too small)
    stale: int = 0
    seconds_in_batches: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def already_landed(self) -> int:
        return self.duplicates + self.stale

    def add(self, counts: list[int], seconds: float) -> None:
        with self._lock:
            self.batches += 1
            self.records += counts[0]
            self.accepted += counts[1]
            self.duplicates += counts[2]
            self.stale += counts[3]
            self.seconds_in_batches += seconds


def build_source(spark: SparkSession, opts: FeedOptions) -> DataFrame:
    """The streaming DataFrame with the columns of :data:`FEED_SCHEMA`."""
    if opts.source == "files":
        reader = spark.readStream.schema(FEED_SCHEMA)
        if opts.max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", opts.max_files_per_trigger)
        if opts.format == "json":
            df = reader.option("mode", "FAILFAST").json(opts.path)
        elif opts.format == "csv":
            # RFC 4180 quoting (a quote inside a field is doubled), which is what a JSON `data` column needs.
            df = reader.option("header", True).option("escape", '"').option("mode", "FAILFAST").csv(opts.path)
        else:
            df = reader.parquet(opts.path)
        return df.select(*FEED_SCHEMA.fieldNames())
    if opts.rows_per_batch is not None:
        df = (
            spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", opts.rows_per_batch)
            .option("numPartitions", opts.num_partitions)
            .option("startTimestamp", opts.start_timestamp_ms)
            .load()
        )
    else:
        df = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", opts.rows_per_second)
            .option("numPartitions", opts.num_partitions)
            .load()
        )
    return rate_to_records(df, opts.topics, opts.topic_prefix)


def rate_to_records(df: DataFrame, topics: int, prefix: str) -> DataFrame:
    """rate rows (timestamp, value) -> records: topic ``prefix + value % topics``, seq ``value // topics``
    (so each topic has seqs 0, 1, 2, ...), data ``{"v": value, "ts": event time in ns}``."""
    value = F.col("value")
    return df.select(
        F.concat(F.lit(prefix), (value % topics).cast("string")).alias("topic"),
        F.to_json(F.struct(value.alias("v"), (F.unix_micros("timestamp") * 1000).alias("ts"))).alias("data"),
        F.floor(value / topics).cast("long").alias("seq"),
        F.col("timestamp").alias("event_time"),
    )


def prepare_batch(df: DataFrame, num_partitions: int, by_topic: bool) -> DataFrame:
    """(topic, seq, data) partitioned for publishing and sorted by seq within each partition.

    ``by_topic``: hash-partitioned by topic, one producer per topic. Spread: the row with seq ``s`` goes to
    partition ``s mod num_partitions``, so consecutive seqs of every topic alternate between the partitions
    and each partition holds the same share of every topic's seq range; that is what bounds ``--lockstep``'s
    reordering to chunk size x partitions (a random round-robin split drifts like a random walk). Rows
    without a seq sort first and keep their source order (``_pos``), which is the order the gateway numbers
    them in; with ``by_topic`` that is one producer per topic, so the source order of a topic holds.
    """
    df = df.select("topic", "seq", "data", F.monotonically_increasing_id().alias("_pos"))
    if by_topic:
        df = df.repartition(num_partitions, "topic")
    else:
        residue = F.pmod(F.coalesce("seq", "_pos"), F.lit(num_partitions))
        keys = F.array(*(F.lit(k) for k in _partition_keys(df.sparkSession, num_partitions)))
        df = df.withColumn("_key", F.element_at(keys, (residue + 1).cast("int")))
        df = df.repartition(num_partitions, "_key")
    return df.sortWithinPartitions(F.col("seq").asc_nulls_first(), "_pos").select("topic", "seq", "data")


_PARTITION_KEYS: dict[int, list[int]] = {}


def _partition_keys(spark: SparkSession, n: int) -> list[int]:
    """``keys[p]`` is a long that ``repartition(n, key)`` sends to partition p.

    Spark hash-partitions by ``pmod(hash(key), n)`` (Murmur3, the same as ``F.hash``); there is no identity
    partitioner for DataFrames, so we look for one preimage per partition among small longs, once per n.
    """
    if n not in _PARTITION_KEYS:
        rows = spark.range(0, 64 * n + 64).select("id", F.pmod(F.hash("id"), F.lit(n)).alias("p")).collect()
        first: dict[int, int] = {}
        for row in rows:
            first.setdefault(row["p"], row["id"])
        if len(first) < n:
            raise RuntimeError(f"no hash preimage found for every one of {n} partitions")
        _PARTITION_KEYS[n] = [first[p] for p in range(n)]
    return _PARTITION_KEYS[n]


def _sync_id(batch_id: int, partition_id: int) -> int:
    # Unique per (batch, partition) so gateway logs can tell connections apart; an integer, the plainest JSON.
    return batch_id * 1_000_000 + partition_id


def _records(rows) -> Iterator[ingest.Record]:
    for row in rows:
        yield row[0], row[1], row[2]


def _counts(result: ingest.SyncResult) -> list[int]:
    return [result.records, result.accepted, result.duplicates, result.stale]


def send_partition(rows, *, batch_id: int, host: str, port: int, chunk_size: int, timeout: float, counters) -> None:
    """Publish one partition over one connection (``foreachPartition`` body, runs in a Python worker).

    Adds ``[records, accepted, duplicates, stale]`` to the ``counters`` accumulators (an action's accumulator
    updates count once per task, whatever its retries); an empty partition opens no connection.
    """
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return
    context = TaskContext.get()
    partition_id = context.partitionId() if context is not None else 0
    result = ingest.publish(
        _records(itertools.chain([first], rows)),
        host=host,
        port=port,
        sync_id=_sync_id(batch_id, partition_id),
        chunk_size=chunk_size,
        timeout=timeout,
    )
    for accumulator, count in zip(counters, _counts(result)):
        accumulator.add(count)


def send_partition_lockstep(
    rows, *, batch_id: int, host: str, port: int, chunk_size: int, timeout: float, coordinator: tuple[str, int]
) -> Iterator[list[int]]:
    """Barrier-stage body: publish one chunk per round, sync it, then wait for every partition's round.

    After round r every partition's chunk r is applied by the gateway, so the records of round r + 1 are at
    most one chunk per partition apart. Every task takes part in every round (an exhausted or empty partition
    just waits) until no task has records left. Yields ``[records, accepted, duplicates, stale]``.
    """
    context = BarrierTaskContext.get()
    partition_id = context.partitionId()
    pending = ingest.chunks(_records(rows), chunk_size)
    chunk = next(pending, None)
    connection: ingest.IngestConnection | None = None
    result: ingest.SyncResult | None = None
    rounds = RoundClient(coordinator, timeout)
    try:
        sync_id = _sync_id(batch_id, partition_id) * 10_000
        while True:
            if chunk is not None:
                if connection is None:
                    connection = ingest.IngestConnection(host, port, timeout)
                connection.send(chunk)
                sync_id += 1
                result = connection.sync(sync_id)
                chunk = next(pending, None)
            if not rounds.next_round(chunk is not None):
                break
    finally:
        rounds.close()
        if connection is not None:
            connection.close()
    if result is not None:
        yield _counts(result)


def publish_batch(batch_df: DataFrame, batch_id: int, opts: FeedOptions) -> list[int]:
    """Publish one micro-batch: one connection per partition; returns the summed
    ``[records, accepted, duplicates, stale]``."""
    prepared = prepare_batch(batch_df, opts.num_partitions, opts.by_topic)
    kwargs = dict(batch_id=batch_id, host=opts.host, port=opts.port, chunk_size=opts.chunk_size, timeout=opts.timeout)
    sc = batch_df.sparkSession.sparkContext
    if not opts.lockstep:
        counters = [sc.accumulator(0) for _ in range(4)]
        prepared.foreachPartition(functools.partial(send_partition, counters=counters, **kwargs))
        return [c.value for c in counters]
    # A barrier stage only has mapPartitions: the counts come back as its result.
    # The coordinator listens where executors reach the driver (loopback in local mode).
    with RoundCoordinator(opts.num_partitions, sc.getConf().get("spark.driver.host", "127.0.0.1"), opts.timeout) as rc:
        body = functools.partial(send_partition_lockstep, coordinator=rc.address, **kwargs)
        partials = prepared.rdd.barrier().mapPartitions(body).collect()
    return [sum(column) for column in zip(*partials)] if partials else [0, 0, 0, 0]


#: Raised by a micro-batch that starts after ``--max-seconds`` asked the query to stop: the batch is neither
#: published nor committed, so the next run takes it.
STOP_REQUESTED = "pipeline feed: stop requested, batch left for the next run"


class _Gate:
    """Lets the driver stop the query between micro-batches rather than in the middle of one (interrupting
    a running foreachBatch leaves a half-published batch, and Spark 4.3 then dies with a StackOverflowError
    in the stream thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = False

    def close(self) -> None:
        """Refuse new batches and wait for the one in flight, if any."""
        self.stopping = True
        with self.lock:
            pass


def make_batch_writer(opts: FeedOptions, stats: FeedStats, gate: _Gate | None = None):
    """The ``foreachBatch`` function for ``opts``."""
    gate = gate or _Gate()

    def write_batch(batch_df: DataFrame, batch_id: int) -> None:
        with gate.lock:
            if gate.stopping:
                raise RuntimeError(STOP_REQUESTED)
            _write_batch(batch_df, batch_id)

    def _write_batch(batch_df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        counts = publish_batch(batch_df, batch_id, opts)
        seconds = time.perf_counter() - started
        stats.add(counts, seconds)
        records, accepted, duplicates, stale = counts
        log.info(
            "batch %d: %d records, %d accepted, %d duplicate_seq, %d stale_seq, %.3f s",
            batch_id, records, accepted, duplicates, stale, seconds,
        )  # fmt: skip
        if stale and accepted:
            # A replay refuses everything (the whole batch landed before) unless the previous attempt died
            # half-way; a first run refuses nothing unless the gateway gave up holes of this batch.
            log.warning(
                "batch %d: %d records accepted and %d refused as stale_seq: either a replay of a batch that was "
                "partly published, or the gateway gave up holes (reorder window or hole timeout too small for "
                "spread mode, see docs/pipeline.md)", batch_id, accepted, stale,
            )  # fmt: skip

    return write_batch


def run_feed(spark: SparkSession, opts: FeedOptions) -> FeedStats:
    """Run the query until it ends (available-now) or ``max_seconds`` pass; re-raise its failure."""
    opts.check()
    slots = spark.sparkContext.defaultParallelism
    if opts.lockstep and opts.num_partitions > slots:
        raise ValueError(f"--lockstep runs all {opts.num_partitions} partitions at once but Spark has {slots} task slots")
    stats = FeedStats()
    checkpoint = opts.checkpoint
    if checkpoint is None:
        checkpoint = tempfile.mkdtemp(prefix="pipeline-feed-checkpoint-")
        log.warning("no --checkpoint: progress will not survive this run")
    gate = _Gate()
    writer = (
        build_source(spark, opts)
        .writeStream.queryName("pipeline-feed")
        .option("checkpointLocation", checkpoint)
        .foreachBatch(make_batch_writer(opts, stats, gate))
    )
    if opts.available_now:
        writer = writer.trigger(availableNow=True)
    elif opts.trigger_seconds is not None:
        writer = writer.trigger(processingTime=f"{opts.trigger_seconds} seconds")
    query = writer.start()
    try:
        if opts.max_seconds is None:
            query.awaitTermination()
        elif not query.awaitTermination(opts.max_seconds):
            log.info("--max-seconds reached: stopping after the micro-batch in flight")
            gate.close()
    except StreamingQueryException as exc:
        if STOP_REQUESTED not in str(exc):
            raise
    finally:
        gate.close()
        if query.isActive:
            query.stop()
        if opts.checkpoint is None:
            shutil.rmtree(checkpoint, ignore_errors=True)
    failure = query.exception()
    if failure is not None and STOP_REQUESTED not in str(failure):
        raise RuntimeError(f"feed query failed: {failure}")
    return stats
