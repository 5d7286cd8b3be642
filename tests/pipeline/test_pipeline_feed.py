"""feed: deterministic streaming runs (rate-micro-batch and files, trigger availableNow) into the ingest
protocol test double (pipeline_ingest_double.py, NOT the gateway: see test_pipeline_e2e.py for that)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.feed import FeedOptions, run_feed
from pipeline.retry import RetryPolicy
from tests.pipeline.pipeline_ingest_double import IngestProtocolDouble

#: The test double has no admin API; a failed connection is retried once, quickly.
NO_ADMIN = dict(admin_url=None, retry=RetryPolicy(1, 0.1, 0.1))

pytestmark = pytest.mark.spark


def rate_options(port: int, checkpoint: Path, **overrides) -> FeedOptions:
    base = dict(source="rate", rows_per_batch=600, topics=3, num_partitions=2, available_now=True,
                port=port, checkpoint=str(checkpoint), chunk_size=50, timeout=20, **NO_ADMIN)  # fmt: skip
    return FeedOptions(**{**base, **overrides})


def assert_every_topic_complete(double: IngestProtocolDouble, topics: int, seqs_per_topic: int) -> None:
    got = double.seqs_by_topic()
    assert sorted(got) == [f"feed.rate-{t}" for t in range(topics)]
    for topic, seqs in got.items():
        assert sorted(seqs) == list(range(seqs_per_topic)), topic


@pytest.mark.parametrize("by_topic", [False, True], ids=["spread", "by-topic"])
def test_rate_micro_batch_reaches_the_ingest(spark, tmp_path, by_topic):
    with IngestProtocolDouble() as double:
        stats = run_feed(spark, rate_options(double.port, tmp_path / "ck", by_topic=by_topic))
    assert (stats.batches, stats.records, stats.accepted, stats.already_landed) == (1, 600, 600, 0)
    assert_every_topic_complete(double, topics=3, seqs_per_topic=200)
    # the rate mapping: topic value % 3, seq value // 3, data {"v": value, "ts": event time in ns}
    for rec in double.landed:
        assert rec.topic == f"feed.rate-{rec.data['v'] % 3}" and rec.seq == rec.data["v"] // 3
        assert isinstance(rec.data["ts"], int)
    conns_of_topic: dict[str, set[int]] = {}
    for rec in double.landed:
        conns_of_topic.setdefault(rec.topic, set()).add(rec.connection)
    # each connection (= partition) sends in seq order
    by_connection: dict[tuple[int, str], list[int]] = {}
    for rec in double.landed:
        by_connection.setdefault((rec.connection, rec.topic), []).append(rec.seq)
    assert all(seqs == sorted(seqs) for seqs in by_connection.values())
    if by_topic:
        # one producer per topic: each topic on one connection, so it arrives in order
        assert all(len(conns) == 1 for conns in conns_of_topic.values())
        assert double.max_displacement() == 0
    else:
        assert double.connections == 2
        assert all(len(conns) == 2 for conns in conns_of_topic.values())


def test_lockstep_bounds_the_reordering_to_chunk_times_partitions(spark, tmp_path):
    with IngestProtocolDouble() as double:
        stats = run_feed(spark, rate_options(double.port, tmp_path / "ck", lockstep=True, chunk_size=50))
    assert (stats.records, stats.accepted) == (600, 600)
    assert_every_topic_complete(double, topics=3, seqs_per_topic=200)
    assert double.connections == 2
    assert double.max_displacement() < 50 * 2  # chunk size x partitions
    assert 12 <= len(double.syncs) <= 14  # one sync per chunk of 50: ~300 rows per partition


def test_lockstep_needs_a_slot_per_partition(spark, tmp_path):
    with IngestProtocolDouble() as double:
        with pytest.raises(Exception, match="task slots"):
            run_feed(spark, rate_options(double.port, tmp_path / "ck", lockstep=True, num_partitions=3))


def test_wall_clock_rate_source_stops_between_batches_after_max_seconds(spark):
    with IngestProtocolDouble() as double:
        opts = FeedOptions(source="rate", rows_per_second=200, topics=2, port=double.port, max_seconds=6,
                           trigger_seconds=0.5, by_topic=True, **NO_ADMIN)  # fmt: skip
        started = time.monotonic()
        stats = run_feed(spark, opts)  # no failure: the batch in flight finished, the next one never began
    assert time.monotonic() - started < 30
    assert stats.batches >= 1 and stats.accepted == stats.records == len(double.landed)
    for seqs in double.seqs_by_topic().values():
        assert seqs == list(range(len(seqs)))  # by topic: in order, from 0


def test_next_run_continues_from_the_checkpoint(spark, tmp_path):
    with IngestProtocolDouble() as double:
        run_feed(spark, rate_options(double.port, tmp_path / "ck", rows_per_batch=90))
        run_feed(spark, rate_options(double.port, tmp_path / "ck", rows_per_batch=90))
    assert_every_topic_complete(double, topics=3, seqs_per_topic=60)


def test_a_replayed_batch_is_idempotent(spark, tmp_path):
    """Batch 0 ran but its commit was lost (the job died after publishing): the restart replays it and
    every record is refused as duplicate_seq, which the sink takes as landed."""
    checkpoint = tmp_path / "ck"
    with IngestProtocolDouble() as double:
        run_feed(spark, rate_options(double.port, checkpoint, rows_per_batch=120))
        for name in ("0", ".0.crc"):  # the commit and Hadoop's checksum of it
            (checkpoint / "commits" / name).unlink(missing_ok=True)
        replay = run_feed(spark, rate_options(double.port, checkpoint, rows_per_batch=120))
    assert replay.already_landed == 120
    assert sorted((r.topic, r.seq) for r in double.landed) == sorted({(r.topic, r.seq) for r in double.landed})
    assert len(double.refused) == 120 and {code for *_, code in double.refused} == {"duplicate_seq"}
    assert_every_topic_complete(double, topics=3, seqs_per_topic=40 * replay.batches)


def test_gateway_refusal_fails_the_query_with_its_message(spark, tmp_path):
    refuse = lambda topic, seq: "unknown_topic" if topic == "feed.rate-1" else None  # noqa: E731
    with IngestProtocolDouble(refuse=refuse) as double:
        with pytest.raises(Exception, match="unknown_topic"):
            run_feed(spark, rate_options(double.port, tmp_path / "ck", rows_per_batch=30))
    # nothing was committed: a restart would retry the batch
    assert not (tmp_path / "ck" / "commits" / "0").exists()


def test_unreachable_gateway_fails_the_query(spark, tmp_path):
    with IngestProtocolDouble() as double:
        port = double.port
    with pytest.raises(Exception, match="Connection refused|ConnectionRefused"):
        run_feed(spark, rate_options(port, tmp_path / "ck", rows_per_batch=30, timeout=2))


FILE_RECORDS = [
    {"topic": "prices", "data": '{"p": 101.5}', "seq": 0},
    {"topic": "prices", "data": '{"p": 101.75, "note": "a, \\"quoted\\" note"}', "seq": 1},
    {"topic": "news", "data": '["x", 1, null]', "seq": 0},
    {"topic": "news", "data": "42", "seq": 1},
    {"topic": "chat", "data": '{"text": "no seq: the gateway numbers me"}', "seq": None},
]


def write_records(directory: Path, fmt: str, name: str, records: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".staging-{name}"  # write elsewhere, then move: the source sees whole files
    if fmt == "json":
        staging.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in records))
    elif fmt == "csv":
        import csv

        with staging.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["topic", "data", "seq", "event_time"])
            writer.writeheader()
            for r in records:
                writer.writerow({**r, "event_time": "2026-01-02T03:04:05Z"})
    else:
        schema = pa.schema([("topic", pa.string()), ("data", pa.string()), ("seq", pa.int64()),
                            ("event_time", pa.timestamp("us", tz="UTC"))])  # fmt: skip
        pq.write_table(pa.Table.from_pylist(records, schema=schema), staging)
    shutil.move(staging, directory / f"{name}.{fmt}")


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_files_source(spark, tmp_path, fmt):
    source = tmp_path / "in"
    write_records(source, fmt, "part-0", FILE_RECORDS)
    opts = FeedOptions(source="files", path=str(source), format=fmt, available_now=True,
                       checkpoint=str(tmp_path / "ck"), timeout=20, **NO_ADMIN)  # fmt: skip
    with IngestProtocolDouble() as double:
        opts = FeedOptions(**{**opts.__dict__, "port": double.port})
        run_feed(spark, opts)
        landed = {(r.topic, r.seq): r.data for r in double.landed}
        assert landed == {
            ("prices", 0): {"p": 101.5},
            ("prices", 1): {"p": 101.75, "note": 'a, "quoted" note'},
            ("news", 0): ["x", 1, None],
            ("news", 1): 42,
            ("chat", 0): {"text": "no seq: the gateway numbers me"},
        }
        # the directory grows: the next run takes only the new file
        write_records(source, fmt, "part-1", [{"topic": "news", "data": "43", "seq": 2}])
        stats = run_feed(spark, opts)
    # (spread mode: seqs 0 and 1 went over two connections at once, in either order; the gateway reorders)
    assert stats.records == 1 and sorted(double.seqs_by_topic()["news"]) == [0, 1, 2]
