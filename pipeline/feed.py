"""feed: Structured Streaming from files or the rate source into the gateway's TCP ingest.

Every micro-batch goes through ``foreachBatch``: the batch is repartitioned (``--by-topic``: by topic, so
each topic has one producer; spread, the default: by ``seq mod n``, so every partition publishes every
topic), sorted by seq within each partition, and each partition is published over its own ingest connection
by :func:`pipeline.ingest.publish` in ``foreachPartition`` (chunks of lines, then ``{"sync": id}``; the Spark
task fails unless the gateway's ``synced`` answer arrives and every record was accepted or answered
``duplicate_seq`` / ``stale_seq``). ``--lockstep`` (spread only) publishes in rounds of one synced chunk per
partition instead (:mod:`pipeline.lockstep`), which bounds the gateway's reordering to chunk x partitions.

Before publishing a micro-batch the driver reads the gateway's settings of its topics through the admin API
(:mod:`pipeline.gatewayapi`) and refuses a plan that cannot work (:mod:`pipeline.plan`), sets malformed input
records aside (:mod:`pipeline.badrecords`), and notes the attempt in the checkpoint's ledger
(:mod:`pipeline.ledger`); after it, the tasks' answers are classified into delivered and lost there, so a
re-run never counts a lost record as landed. A micro-batch that lost records fails the query (not committed)
unless ``allow_loss``.

A failed task fails the batch and the query; restarted on the same ``--checkpoint``, Spark runs the batch
again and records with explicit seqs that already landed are refused as duplicate/stale, so nothing is
published twice. Records without a seq get the gateway's next seq: a retried batch publishes them again
(not idempotent). See docs/pipeline.md.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from pyspark import BarrierTaskContext, StorageLevel, TaskContext
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipeline import badrecords, ingest
from pipeline.errors import BadInput, LossError, PipelineError, PlanError
from pipeline.feed_metrics import FeedMetrics
from pipeline.gatewayapi import DEFAULT_ADMIN_URL, AdminClient, TopicState
from pipeline.ledger import BatchOutcome, Ledger, classify
from pipeline.lockstep import RoundClient, RoundCoordinator
from pipeline.plan import TopicFacts, plan_problems
from pipeline.retry import DEFAULT_RETRY, RetryPolicy
from pipeline.spark import master_url

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

#: Epoch recorded for every topic when the feed runs without the admin API (``admin_url=None``).
UNKNOWN_EPOCH = "unknown"


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
    topic_prefix: str = "feed.rate-"
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
    #: the gateway's admin API (topic settings, epochs, available ends); None: publish without it (no plan
    #: check, and loss is only what the gateway answers ``skipped_seq``)
    admin_url: str | None = DEFAULT_ADMIN_URL
    #: its bearer token (None: the environment variable GATEWAY_SERVER_ADMIN_TOKEN)
    admin_token: str | None = None
    #: commit micro-batches that lost records (they are still reported) instead of failing the query
    allow_loss: bool = False
    #: reconnecting to the gateway (ingest in the tasks, admin API on the driver)
    retry: RetryPolicy = DEFAULT_RETRY
    #: records written between two syncs of one connection (what is written again after a reconnect)
    sync_every: int = ingest.DEFAULT_SYNC_EVERY
    #: dead-letter directory for malformed input records (files source); None: a bad record fails the query
    bad_records: str | None = None
    #: more bad records than this in one micro-batch fails it even with ``bad_records`` (a wrong --format?)
    max_bad_records: int = 1000
    #: Prometheus textfile of the query's metrics
    metrics_file: str | None = None
    #: seconds to wait for a cluster's executors to offer the task slots --lockstep needs
    slots_wait: float = 30.0

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
        for name in ("topics", "num_partitions", "chunk_size", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.bad_records is not None and self.source != "files":
            raise ValueError("--bad-records is for --source files")


@dataclass
class FeedStats:
    """What the query published, summed over batches on the driver (``foreachBatch`` runs there)."""

    batches: int = 0
    records: int = 0
    #: accepted by the gateway in this run
    accepted: int = 0
    #: refused as duplicate/stale, landed by an earlier attempt of the same batch (a replay) or on a
    #: connection that broke; ``unverified`` of them after an attempt that died before recording its outcome
    landed_earlier: int = 0
    unverified: int = 0
    #: refused as duplicate/stale and there before the batch: not delivered by this feed, not lost
    already_present: int = 0
    #: refused as skipped_seq, or given up by the gateway and gone from the ring
    lost: int = 0
    #: topic -> records lost in this run
    lost_by_topic: dict[str, int] = field(default_factory=dict)
    bad_records: int = 0
    input_duplicates: int = 0
    reconnects: int = 0
    #: micro-batches that found topics in a new epoch (the gateway restarted)
    restarts: int = 0
    #: raw answers, as the gateway gave them
    duplicates: int = 0
    stale: int = 0
    skipped: int = 0
    seconds_in_batches: float = 0.0
    #: records lost by batches of this checkpoint committed before this run (with --allow-loss), and which
    earlier_lost: int = 0
    earlier_lossy_batches: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def delivered(self) -> int:
        """Records in the gateway's ring thanks to this feed: accepted now or by an earlier attempt."""
        return self.accepted + self.landed_earlier

    @property
    def already_landed(self) -> int:
        """Records refused as already there (landed earlier, or present before the batch)."""
        return self.landed_earlier + self.already_present

    def add(self, outcome: BatchOutcome, answers: dict[str, int]) -> None:
        with self._lock:
            self.batches += 1
            self.records += outcome.records
            self.accepted += outcome.accepted
            self.landed_earlier += outcome.landed_earlier
            self.unverified += outcome.unverified
            self.already_present += outcome.already_present
            self.lost += outcome.lost_count
            for topic, entry in outcome.lost.items():
                self.lost_by_topic[topic] = self.lost_by_topic.get(topic, 0) + sum(b - a for a, b in entry["ranges"])
            self.bad_records += outcome.bad_records
            self.input_duplicates += outcome.input_duplicates
            self.reconnects += outcome.reconnects
            self.duplicates += answers.get("duplicate_seq", 0)
            self.stale += answers.get("stale_seq", 0)
            self.skipped += answers.get("skipped_seq", 0)
            self.seconds_in_batches += outcome.seconds

    def summary(self) -> str:
        """The feed's last line: delivered vs lost, and what else happened."""
        rate = self.records / self.seconds_in_batches if self.seconds_in_batches else 0.0
        parts = [
            f"{self.batches} batches, {self.records} records: {self.delivered} delivered into the ring "
            f"({self.accepted} accepted now, {self.landed_earlier} landed earlier"
            + (f", {self.unverified} of them unverified" if self.unverified else "")
            + f"), {self.lost} lost"
        ]
        if self.lost_by_topic:
            worst = sorted(self.lost_by_topic.items(), key=lambda kv: -kv[1])[:3]
            parts[-1] += " (" + ", ".join(f"{t} {n}" for t, n in worst) + ")"
        if self.already_present:
            parts.append(f"{self.already_present} already present before this feed")
        if self.bad_records:
            parts.append(f"{self.bad_records} bad input records set aside")
        if self.input_duplicates:
            parts.append(f"{self.input_duplicates} repeated input records dropped")
        if self.reconnects:
            parts.append(f"{self.reconnects} reconnects")
        if self.restarts:
            parts.append(f"gateway restarted (new epoch) {self.restarts} times")
        if self.earlier_lost:
            parts.append(
                f"earlier runs on this checkpoint lost {self.earlier_lost} records "
                f"(batches {', '.join(map(str, self.earlier_lossy_batches[:5]))})"
            )
        parts.append(f"{rate:,.0f} records/s while publishing")
        return "; ".join(parts)


#: Extra columns of the files source: the line Spark could not parse (JSON, CSV) and the file of each row.
FILE_COLUMNS = (badrecords.CORRUPT, "_file")


def build_source(spark: SparkSession, opts: FeedOptions) -> DataFrame:
    """The streaming DataFrame with the columns of :data:`FEED_SCHEMA` (the files source also has
    :data:`FILE_COLUMNS`: bad records are sorted out per micro-batch, with their file and line)."""
    if opts.source == "files":
        path = opts.path
        if not path:
            raise ValueError("--source files needs --path")
        if opts.format == "parquet":
            reader = spark.readStream.schema(FEED_SCHEMA)
        else:
            schema = T.StructType([*FEED_SCHEMA.fields, T.StructField(badrecords.CORRUPT, T.StringType())])
            reader = (
                spark.readStream.schema(schema)
                .option("mode", "PERMISSIVE")
                .option("columnNameOfCorruptRecord", badrecords.CORRUPT)
            )
        if opts.max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", opts.max_files_per_trigger)
        if opts.format == "json":
            df = reader.json(path)
        elif opts.format == "csv":
            # RFC 4180 quoting (a quote inside a field is doubled), which is what a JSON `data` column needs.
            df = reader.option("header", True).option("escape", '"').csv(path)
        else:
            df = reader.parquet(path).withColumn(badrecords.CORRUPT, F.lit(None).cast("string"))
        return df.select(*FEED_SCHEMA.fieldNames(), badrecords.CORRUPT, F.col("_metadata.file_path").alias("_file"))
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


def _records(rows: Iterable[Row], outcome: ingest.PartitionOutcome) -> Iterator[ingest.Record]:
    """The partition's rows as records; a row with the same (topic, seq) as the one before is dropped (and
    counted): the gateway would refuse it, and its refusal would read as loss or as landed."""
    previous: tuple[str, int | None] | None = None
    for row in rows:
        topic, seq = row[0], row[1]
        if seq is not None and (topic, seq) == previous:
            outcome.input_duplicates += 1
            continue
        previous = (topic, seq)
        yield topic, seq, row[2]


def send_partition(
    rows: Iterable[Row],
    *,
    batch_id: int,
    host: str,
    port: int,
    chunk_size: int,
    timeout: float,
    retry: RetryPolicy,
    sync_every: int,
) -> Iterator[ingest.PartitionOutcome]:
    """Publish one partition (``mapPartitions`` body, runs in a Python worker): groups of ``sync_every``
    records, each written in chunks of ``chunk_size`` lines and synced, over one connection that is made
    again after a failure (:class:`pipeline.ingest.Publisher`). Yields the partition's outcome; an empty
    partition opens no connection."""
    context = TaskContext.get()
    partition_id = context.partitionId() if context is not None else 0
    publisher = ingest.Publisher(
        host, port, timeout=timeout, retry=retry, chunk_size=chunk_size, sync_base=_sync_id(batch_id, partition_id) * 10_000
    )
    input_duplicates = ingest.PartitionOutcome()
    with publisher:
        for group in ingest.chunks(_records(rows, input_duplicates), sync_every):
            publisher.publish(group)
    outcome = publisher.finish()
    outcome.input_duplicates = input_duplicates.input_duplicates
    yield outcome


def send_partition_lockstep(
    rows: Iterable[Row],
    *,
    batch_id: int,
    host: str,
    port: int,
    chunk_size: int,
    timeout: float,
    retry: RetryPolicy,
    coordinator: tuple[str, int],
) -> Iterator[ingest.PartitionOutcome]:
    """Barrier-stage body: publish one chunk per round, sync it, then wait for every partition's round.

    After round r every partition's chunk r is applied by the gateway, so the records of round r + 1 are at
    most one chunk per partition apart. Every task takes part in every round (an exhausted or empty partition
    just waits) until no task has records left. Yields the partition's outcome.
    """
    context = BarrierTaskContext.get()
    partition_id = context.partitionId()
    input_duplicates = ingest.PartitionOutcome()
    pending = ingest.chunks(_records(rows, input_duplicates), chunk_size)
    chunk = next(pending, None)
    publisher = ingest.Publisher(
        host, port, timeout=timeout, retry=retry, chunk_size=chunk_size, sync_base=_sync_id(batch_id, partition_id) * 10_000
    )
    rounds = RoundClient(coordinator, timeout)
    try:
        while True:
            if chunk is not None:
                publisher.publish(chunk)
                chunk = next(pending, None)
            if not rounds.next_round(chunk is not None):
                break
    finally:
        rounds.close()
        publisher.close()
    outcome = publisher.finish()
    outcome.input_duplicates = input_duplicates.input_duplicates
    yield outcome


def task_slots(spark: SparkSession, needed: int, wait: float) -> int:
    """Tasks the cluster can run at once (what Spark's barrier scheduling checks: executors' cores /
    ``spark.task.cpus``), waiting up to ``wait`` seconds for executors to register until ``needed``."""
    sc = spark.sparkContext._jsc.sc()
    deadline = time.monotonic() + wait
    settled: float | None = None
    while True:
        try:
            profile = sc.resourceProfileManager().defaultResourceProfile()
            slots = int(sc.maxNumConcurrentTasks(profile))
        except Exception:  # noqa: BLE001 - an internal API: fall back to what PySpark says
            slots = spark.sparkContext.defaultParallelism
        now = time.monotonic()
        if slots and settled is None:
            settled = now + 3.0  # executors register one by one: a little longer for the others
        if slots >= needed or now >= deadline or (settled is not None and now >= settled):
            return slots
        time.sleep(0.25)


def publish_batch(batch_df: DataFrame, batch_id: int, opts: FeedOptions) -> list[ingest.PartitionOutcome]:
    """Publish one micro-batch, one connection per partition; the partitions' outcomes."""
    prepared = prepare_batch(batch_df, opts.num_partitions, opts.by_topic)
    if not opts.lockstep:
        body = functools.partial(
            send_partition,
            batch_id=batch_id,
            host=opts.host,
            port=opts.port,
            chunk_size=opts.chunk_size,
            timeout=opts.timeout,
            retry=opts.retry,
            sync_every=opts.sync_every,
        )
        return prepared.rdd.mapPartitions(body).collect()
    sc = batch_df.sparkSession.sparkContext
    # A barrier stage runs all its tasks at once; the coordinator listens where executors reach the driver
    # (loopback in local mode).
    with RoundCoordinator(opts.num_partitions, sc.getConf().get("spark.driver.host", "127.0.0.1"), opts.timeout) as rc:
        barrier_body = functools.partial(
            send_partition_lockstep,
            batch_id=batch_id,
            host=opts.host,
            port=opts.port,
            chunk_size=opts.chunk_size,
            timeout=opts.timeout,
            retry=opts.retry,
            coordinator=rc.address,
        )
        return prepared.rdd.barrier().mapPartitions(barrier_body).collect()


def merge_outcomes(parts: Iterable[ingest.PartitionOutcome]) -> dict:
    """The partitions' outcomes summed, seqs expanded (the driver's view of one attempt)."""
    total: dict[str, Any] = {"records": 0, "accepted": 0, "landed_on_resend": 0, "reconnects": 0, "input_duplicates": 0,
             "unsequenced_resent": 0, "refusals": {}, "lost_on_resend": {}, "answers": {}}  # fmt: skip
    for part in parts:
        for key in ("records", "accepted", "landed_on_resend", "reconnects", "input_duplicates", "unsequenced_resent"):
            total[key] += getattr(part, key)
        for (topic, code), runs in part.refusals.items():
            seqs = list(ingest.expand(runs))
            total["refusals"].setdefault((topic, code), []).extend(seqs)
            total["answers"][code] = total["answers"].get(code, 0) + len(seqs)
        for topic, runs in part.lost_on_resend.items():
            seqs = list(ingest.expand(runs))
            total["lost_on_resend"].setdefault(topic, []).extend(seqs)
            total["answers"]["skipped_seq"] = total["answers"].get("skipped_seq", 0) + len(seqs)
    total["answers"]["resent_landed"] = total["landed_on_resend"]
    return total


# -- the driver's side of a micro-batch -------------------------------------------------------------------


def batch_facts(batch: DataFrame, files: bool) -> tuple[list[TopicFacts], int, datetime | None]:
    """(facts per topic of the good rows, number of bad rows, newest event_time) in one Spark job."""
    topic = F.when(F.col("_bad").isNull(), F.col("topic")) if files else F.col("topic")
    rows = (
        batch.groupBy(topic.alias("topic"))
        .agg(F.count(F.lit(1)).alias("records"), F.count("seq").alias("sequenced"), F.min("seq").alias("min_seq"),
             F.max("seq").alias("max_seq"), F.max("event_time").alias("newest"))
        .collect()
    )  # fmt: skip
    facts: list[TopicFacts] = []
    bad = 0
    newest: datetime | None = None
    for row in rows:
        if row["topic"] is None:
            bad += row["records"]
            continue
        facts.append(TopicFacts(row["topic"], row["records"], row["sequenced"], row["min_seq"], row["max_seq"]))
        if row["newest"] is not None and (newest is None or row["newest"] > newest):
            newest = row["newest"]
    return sorted(facts, key=lambda f: f.topic), bad, newest


def collect_bad(batch: DataFrame, fmt: str, limit: int) -> list[badrecords.BadRecord]:
    rows = (
        batch.where(F.col("_bad").isNotNull())
        .select("_file", badrecords.CORRUPT, "topic", "seq", "data", "_bad")
        .limit(limit)
        .collect()
    )
    bad = [
        badrecords.BadRecord(
            file=row["_file"], reason=row["_bad"],
            record=row[badrecords.CORRUPT] if row[badrecords.CORRUPT] is not None else
            {"topic": row["topic"], "seq": row["seq"], "data": row["data"]},
        )
        for row in rows
    ]  # fmt: skip
    badrecords.locate(fmt, bad)
    return bad


def rate_facts(opts: FeedOptions) -> list[TopicFacts]:
    """The per-topic shape of one rate-micro-batch micro-batch (the first one; the others are the same)."""
    n = opts.rows_per_batch or 0
    facts = []
    for t in range(min(opts.topics, n)):
        rows = len(range(t, n, opts.topics))
        facts.append(TopicFacts(f"{opts.topic_prefix}{t}", rows, rows, 0, rows - 1))
    return facts


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


@dataclass
class _Run:
    """The driver's state for one run of the query (``foreachBatch`` runs on the driver)."""

    opts: FeedOptions
    stats: FeedStats
    ledger: Ledger
    admin: AdminClient | None
    metrics: FeedMetrics
    #: topic -> the latest epoch seen (from the ledger, then from every micro-batch; None: not created yet)
    epochs: dict[str, str | None] = field(default_factory=dict)
    batches: set[int] = field(default_factory=set)
    #: the exception a micro-batch raised on the driver (Spark's wrapping of it is less readable)
    failure: BaseException | None = None

    # -- gateway state -----------------------------------------------------------------------------------
    def topic_states(self, topics: list[str]) -> dict[str, TopicState] | None:
        return self.admin.topics(topics) if self.admin is not None else None

    def start_of(self, topics: list[str], states: dict[str, TopicState] | None) -> dict[str, dict]:
        if states is None:
            return {t: {"epoch": UNKNOWN_EPOCH, "end": None} for t in topics}
        return {t: {"epoch": states[t].epoch, "end": states[t].end} for t in topics}

    def note_epochs(self, batch_id: int, epochs: dict[str, str | None], during: bool) -> bool:
        """Compare with the epochs seen before; say so when the gateway restarted. Whether it did."""
        changed = [
            (t, self.epochs[t], e)
            for t, e in sorted(epochs.items())
            if self.epochs.get(t) is not None and e != self.epochs[t] and e != UNKNOWN_EPOCH
        ]
        # a topic gone with the restart (None) takes its new epoch later without a second report
        self.epochs.update(epochs)
        if not changed:
            return False
        self.stats.restarts += 1
        shown = ", ".join(f"{t} epoch {a} -> {b or '(not created yet)'}" for t, a, b in changed[:3])
        more = f" and {len(changed) - 3} more topics" if len(changed) > 3 else ""
        when = f"during micro-batch {batch_id}" if during else f"before micro-batch {batch_id}"
        log.warning(
            "gateway restarted (new epoch) %s: %s%s; what was published before is not in the new epoch "
            "(subscribers that resume get an `epoch` loss notice)",
            when,
            shown,
            more,
        )
        return True

    # -- one micro-batch -----------------------------------------------------------------------------------
    def write_batch(self, batch_df: DataFrame, batch_id: int) -> None:
        opts = self.opts
        started = time.perf_counter()
        files = opts.source == "files"
        batch = batch_df
        if files:
            batch = batch_df.withColumn("_bad", badrecords.bad_reason(opts.format)).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            if opts.source == "rate" and opts.rows_per_batch:
                # rate-micro-batch: every micro-batch has the shape checked at start, no Spark job needed
                facts, bad_count, newest = rate_facts(opts), 0, None
            else:
                facts, bad_count, newest = batch_facts(batch, files)
            facts_done = time.perf_counter()
            good = batch
            if bad_count:
                good = batch.where(F.col("_bad").isNull())
                self._set_aside(batch, batch_id, bad_count)
            topics = [f.topic for f in facts]
            states = self.topic_states(topics) if topics else None
            if states is not None:
                problems = plan_problems(
                    states,
                    facts,
                    by_topic=opts.by_topic,
                    lockstep=opts.lockstep,
                    chunk_size=opts.chunk_size,
                    partitions=opts.num_partitions,
                )
                if problems:
                    more = f" (and {len(problems) - 1} more topics)" if len(problems) > 1 else ""
                    raise PlanError(f"micro-batch {batch_id}: {problems[0]}{more}")
            start = self.start_of(topics, states)
            restarted = self.note_epochs(batch_id, {t: s["epoch"] for t, s in start.items()}, during=False)
            prior, start, attempt = self.ledger.begin(batch_id, start)
            if attempt > 1:
                log.warning(
                    "micro-batch %d: attempt %d (a replay): records that landed before are refused and "
                    "counted as landed earlier, those recorded as lost stay lost",
                    batch_id,
                    attempt,
                )
            publish_started = time.perf_counter()
            parts = publish_batch(good.select("topic", "seq", "data"), batch_id, opts) if topics else []
            publish_seconds = time.perf_counter() - publish_started
            total = merge_outcomes(parts)
            outcome = classify(batch_id, accepted=total["accepted"], refusals=total["refusals"],
                               lost_on_resend=total["lost_on_resend"], landed_on_resend=total["landed_on_resend"],
                               start=start, prior=prior)  # fmt: skip
            outcome.attempt = attempt
            outcome.records = total["records"]
            outcome.input_duplicates = total["input_duplicates"]
            outcome.bad_records = bad_count
            outcome.reconnects = total["reconnects"]
            outcome.unsequenced_resent = total["unsequenced_resent"]
            after = {t: s["epoch"] for t, s in start.items()}
            if self.admin is not None and topics and (total["reconnects"] or any(e is None for e in after.values())):
                after = {t: s.epoch for t, s in self.admin.topics(topics).items()}
            restarted = self.note_epochs(batch_id, after, during=True) or restarted
            outcome.set_epochs(after)
            outcome.allowed = bool(outcome.lost) and opts.allow_loss
            outcome.seconds = time.perf_counter() - started
            self.ledger.finish(outcome)
            self.batches.add(batch_id)
            self.stats.add(outcome, total["answers"])
            lag = time.time() - newest.timestamp() if newest is not None else None
            self.metrics.batch(outcome, sum(f.records for f in facts) + bad_count, lag, restarted)
            log.info("batch %d: %d records, %d accepted, %d landed earlier, %d already present, %d lost, answers %s, "
                     "%d reconnects, %.3f s (facts %.3f s, publishing %.3f s)", batch_id, outcome.records,
                     outcome.accepted, outcome.landed_earlier, outcome.already_present, outcome.lost_count,
                     total["answers"], outcome.reconnects, outcome.seconds, facts_done - started,
                     publish_seconds)  # fmt: skip
            if outcome.unsequenced_resent:
                log.warning(
                    "micro-batch %d: %d records without a seq were written again after a reconnect: they "
                    "may have been published twice (only explicit seqs make publishing idempotent)",
                    batch_id,
                    outcome.unsequenced_resent,
                )
            if outcome.lost:
                text = (
                    f"micro-batch {batch_id}: {outcome.lost_count} of {outcome.records} records lost "
                    f"({outcome.lost_text()}): refused as skipped_seq, or given up by the gateway (reorder "
                    f"window, hole_timeout) and gone from the ring"
                )
                if not opts.allow_loss:
                    raise LossError(f"{text}; not committed: a re-run reports the same loss, --allow-loss goes on")
                log.warning("%s; committed (--allow-loss)", text)
        finally:
            if files:
                batch.unpersist()

    def _set_aside(self, batch: DataFrame, batch_id: int, bad_count: int) -> None:
        opts = self.opts
        if opts.bad_records is None or bad_count > opts.max_bad_records:
            first = collect_bad(batch, opts.format, 1)[0]
            hint = (
                "--bad-records DIR sets them aside"
                if opts.bad_records is None
                else f"more than --max-bad-records {opts.max_bad_records}: is --format right?"
            )
            raise BadInput(f"{first.one_line()} ({bad_count} bad records in micro-batch {batch_id}; {hint})")
        bad = collect_bad(batch, opts.format, bad_count)
        path = badrecords.write_dead_letters(opts.bad_records, batch_id, bad)
        log.warning(
            "micro-batch %d: %d bad input records set aside in %s; the first: %s", batch_id, len(bad), path, bad[0].one_line()
        )


def make_batch_writer(run: _Run, gate: _Gate | None = None) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function of a run."""
    gate = gate or _Gate()

    def write_batch(batch_df: DataFrame, batch_id: int) -> None:
        with gate.lock:
            if gate.stopping:
                raise RuntimeError(STOP_REQUESTED)
            try:
                run.write_batch(batch_df, batch_id)
            except BaseException as exc:
                run.failure = exc
                raise

    return write_batch


def preflight(opts: FeedOptions) -> None:
    """What can be checked before Spark starts: the options, and with the rate-micro-batch source (whose
    micro-batches all have the same shape) the plan against the gateway's topic settings. Raises
    ``ValueError``, :class:`PlanError`, :class:`pipeline.errors.GatewayUnreachable`, ``AdminRefused``."""
    opts.check()
    if opts.admin_url and opts.source == "rate" and opts.rows_per_batch:
        with AdminClient(opts.admin_url, opts.admin_token, retry=opts.retry) as admin:
            _check_plan_at_start(admin, opts)


def _check_plan_at_start(admin: AdminClient, opts: FeedOptions) -> None:
    facts = rate_facts(opts)
    states = admin.topics([f.topic for f in facts])
    for state in states.values():
        log.info("%s", state.describe())
    problems = plan_problems(
        states, facts, by_topic=opts.by_topic, lockstep=opts.lockstep, chunk_size=opts.chunk_size, partitions=opts.num_partitions
    )
    if problems:
        more = f" (and {len(problems) - 1} more topics)" if len(problems) > 1 else ""
        raise PlanError(f"{problems[0]}{more}")


def run_feed(spark: SparkSession, opts: FeedOptions) -> FeedStats:
    """Run the query until it ends (available-now) or ``max_seconds`` pass; re-raise its failure (the
    exception carries the run's :class:`FeedStats` as ``stats``)."""
    opts.check()
    stats = FeedStats()
    if opts.lockstep:
        local = master_url(spark).startswith("local")
        slots = task_slots(spark, opts.num_partitions, 0.0 if local else opts.slots_wait)
        if opts.num_partitions > slots:
            raise PlanError(
                f"--lockstep runs all {opts.num_partitions} partitions at once (a barrier stage) but Spark has "
                f"{slots} task slots (executor cores / spark.task.cpus, {spark.sparkContext.master}): lower "
                f"--num-partitions or give the executors more cores"
            )
    admin = AdminClient(opts.admin_url, opts.admin_token, retry=opts.retry) if opts.admin_url else None
    checkpoint = opts.checkpoint
    metrics = FeedMetrics(opts.metrics_file)
    query = None
    run = None
    try:
        if admin is not None and opts.source == "rate" and opts.rows_per_batch:
            _check_plan_at_start(admin, opts)
        if checkpoint is None:
            checkpoint = tempfile.mkdtemp(prefix="pipeline-feed-checkpoint-")
            log.warning("no --checkpoint: progress will not survive this run")
        ledger = Ledger.in_checkpoint(checkpoint, spark)
        epochs: dict[str, str | None] = dict(ledger.epochs)
        run = _Run(opts, stats, ledger, admin, metrics, epochs=epochs)
        gate = _Gate()
        metrics.attach(spark, "pipeline-feed")
        writer = (
            build_source(spark, opts)
            .writeStream.queryName("pipeline-feed")
            .option("checkpointLocation", checkpoint)
            .foreachBatch(make_batch_writer(run, gate))
        )
        if opts.available_now:
            writer = writer.trigger(availableNow=True)
        elif opts.trigger_seconds is not None:
            writer = writer.trigger(processingTime=f"{opts.trigger_seconds} seconds")
        query = writer.start()
        try:
            if opts.max_seconds is None:
                query.awaitTermination()
            # seconds as a float are fine (pyspark waits int(timeout * 1000) ms); its annotation says int
            elif not query.awaitTermination(opts.max_seconds):  # type: ignore[arg-type]
                log.info("--max-seconds reached: stopping after the micro-batch in flight")
                gate.close()
        except StreamingQueryException as exc:
            if STOP_REQUESTED not in str(exc):
                raise
        finally:
            gate.close()
            if query.isActive:
                query.stop()
    except BaseException as exc:
        failure = run.failure if run is not None and run.failure is not None else exc
        if isinstance(failure, (PipelineError, ValueError)) and failure is not exc:
            raise _carrying(failure, stats) from None
        _carrying(exc, stats)
        raise
    finally:
        if run is not None:  # what batches before this run lost (committed with --allow-loss)
            lossy = run.ledger.summary.get("lossy", {})
            earlier = sorted(int(b) for b in lossy if int(b) not in run.batches)
            stats.earlier_lost = sum(lossy[str(b)]["lost"] for b in earlier)
            stats.earlier_lossy_batches = earlier
        if admin is not None:
            admin.close()
        metrics.close()
        if opts.checkpoint is None and checkpoint is not None:
            shutil.rmtree(checkpoint, ignore_errors=True)
    query_failure = query.exception()
    if query_failure is not None and STOP_REQUESTED not in str(query_failure):
        if run.failure is not None and isinstance(run.failure, PipelineError):
            raise _carrying(run.failure, stats)
        raise _carrying(RuntimeError(f"feed query failed: {query_failure}"), stats)
    return stats


_E = TypeVar("_E", bound=BaseException)


def _carrying(exc: _E, stats: FeedStats) -> _E:
    """``exc`` with the run's figures as ``exc.stats`` (the CLI prints them after a failure)."""
    exc.stats = stats  # type: ignore[attr-defined]  # any exception may carry them: set, not declared
    return exc
