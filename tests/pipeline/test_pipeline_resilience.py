"""Resilience of the feed (issue 12, step 3): a gateway restarted mid-stream (bounded retries, the new epoch
reported), malformed input records set aside in a dead-letter directory with their file and line, and the
query's metrics in a Prometheus textfile."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace

import orjson
import pytest

from loadtest.ports import free_port
from pipeline.errors import BadInput
from pipeline.feed import FeedOptions, run_feed
from pipeline.retry import RetryPolicy
from tests.pipeline.pipeline_ingest_double import IngestProtocolDouble

gateway_testing = pytest.importorskip("gateway.testing")

pytestmark = pytest.mark.spark


def test_gateway_restart_mid_stream(spark, tmp_path, caplog):
    http_port, ingest_port = free_port(), free_port()
    ports = dict(server={"port": http_port}, ingest={"port": ingest_port})
    opts = FeedOptions(source="rate", rows_per_batch=4000, topics=2, trigger_seconds=0.3, max_seconds=10,
                       port=ingest_port, admin_url=f"http://127.0.0.1:{http_port}",
                       admin_token=gateway_testing.TEST_TOKEN, checkpoint=str(tmp_path / "ck"), timeout=10,
                       retry=RetryPolicy(10, 0.2, 1.0), metrics_file=str(tmp_path / "feed.prom"))  # fmt: skip
    result: dict = {}

    def feed() -> None:
        try:
            result["stats"] = run_feed(spark, opts)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    caplog.set_level(logging.WARNING)
    with gateway_testing.run_gateway(**ports) as first:
        thread = threading.Thread(target=feed)
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not first.call(lambda: first.hub.scheduler.engine.topic_count):
            time.sleep(0.2)
        time.sleep(2)
    time.sleep(1.5)  # down for a while: admin calls and connections fail, and are retried
    with gateway_testing.run_gateway(**ports) as second:
        thread.join(60)
        assert not thread.is_alive()
        after = second.call(lambda: [t.info() for t in second.hub.scheduler.engine.topics()])
    assert "error" not in result, result.get("error")
    stats = result["stats"]
    assert stats.restarts >= 1 and stats.lost == 0 and stats.batches >= 3
    assert "gateway restarted (new epoch)" in caplog.text
    assert all(info["end"] + info["pending"] > 0 for info in after), after  # the feed went on into the new one
    metrics = (tmp_path / "feed.prom").read_text()
    assert "fanout_feed_gateway_restarts_total 1" in metrics or "fanout_feed_gateway_restarts_total 2" in metrics
    assert "fanout_feed_up 0" in metrics
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    # Spark's own figures, from the query's progress (a StreamingQueryListener)
    assert float(values["fanout_feed_processed_rows_per_second"]) > 0
    assert float(values["fanout_feed_batch_duration_seconds"]) > 0


def test_unreachable_gateway_names_host_and_port(spark, tmp_path):
    port = free_port()
    opts = FeedOptions(source="rate", rows_per_batch=10, available_now=True, port=port,
                       admin_url=f"http://127.0.0.1:{port}", admin_token="x", checkpoint=str(tmp_path / "ck"),
                       retry=RetryPolicy(1, 0.1, 0.1))  # fmt: skip
    with pytest.raises(Exception, match=rf"cannot reach the gateway's admin API at 127.0.0.1:{port}"):
        run_feed(spark, opts)
    with IngestProtocolDouble() as double:
        gone = double.port
    with pytest.raises(Exception, match=rf"cannot reach the gateway's ingest at 127.0.0.1:{gone} \(1 retries"):
        run_feed(spark, replace(opts, port=gone, admin_url=None))


BAD_JSON_LINES = [
    '{"topic": "t.a", "data": "{\\"x\\": 1}", "seq": 0}',
    "not json at all",
    '{"topic": "t.a", "data": "{\\"x\\": 2}", "seq": 1}',
    '{"data": "3", "seq": 2}',
    '{"topic": "t.a", "data": "1, 2", "seq": 3}',
    '{"topic": "t.a", "data": "4", "seq": "four"}',
    '{"topic": "t.a", "data": "5", "seq": 4}',
]


def write_bad_file(directory) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / "staging.json"
    staging.write_text("\n".join(BAD_JSON_LINES) + "\n")
    target = directory / "part-0.json"
    staging.rename(target)
    return str(target)


def test_a_bad_record_fails_with_file_and_line(spark, tmp_path):
    path = write_bad_file(tmp_path / "in")
    opts = FeedOptions(source="files", path=str(tmp_path / "in"), available_now=True, admin_url=None,
                       checkpoint=str(tmp_path / "ck"), retry=RetryPolicy(0, 0, 0))  # fmt: skip
    with IngestProtocolDouble() as double:
        with pytest.raises(
            BadInput,
            match=rf"bad input record in file:{path} line \d: .*\(4 bad records in "
            r"micro-batch 0; --bad-records DIR sets them aside\)",
        ):
            run_feed(spark, replace(opts, port=double.port))
        assert double.landed == []  # nothing published


def test_bad_records_go_to_the_dead_letter_directory(spark, tmp_path):
    path = write_bad_file(tmp_path / "in")
    opts = FeedOptions(source="files", path=str(tmp_path / "in"), available_now=True, admin_url=None,
                       checkpoint=str(tmp_path / "ck"), bad_records=str(tmp_path / "dead"), by_topic=True,
                       metrics_file=str(tmp_path / "m" / "feed.prom"))  # fmt: skip
    with IngestProtocolDouble() as double:
        stats = run_feed(spark, replace(opts, port=double.port))
        assert sorted(double.seqs_by_topic()["t.a"]) == [0, 1, 4]
    assert (stats.bad_records, stats.delivered, stats.lost) == (4, 3, 0)
    dead = [json.loads(line) for line in (tmp_path / "dead" / "batch-0.jsonl").read_text().splitlines()]
    by_line = {d["line"]: d for d in dead}
    assert sorted(by_line) == [2, 4, 5, 6] and all(d["file"] == f"file:{path}" for d in dead)
    assert by_line[2]["record"] == "not json at all" and by_line[2]["reason"].startswith("not a JSON object")
    assert by_line[4]["reason"] == "no topic"
    assert by_line[5]["reason"] == "data is not JSON text"
    assert by_line[6]["record"] == BAD_JSON_LINES[5]
    metrics = (tmp_path / "m" / "feed.prom").read_text()
    assert 'fanout_feed_records_total{outcome="bad"} 4' in metrics
    assert 'fanout_feed_records_total{outcome="delivered"} 3' in metrics
    assert "# TYPE fanout_feed_batch_duration_seconds gauge" in metrics


def test_a_file_of_garbage_is_not_dead_lettered_line_by_line(spark, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.json").write_text("garbage\n" * 20)
    opts = FeedOptions(source="files", path=str(tmp_path / "in"), available_now=True, admin_url=None,
                       checkpoint=str(tmp_path / "ck"), bad_records=str(tmp_path / "dead"), max_bad_records=5)  # fmt: skip
    with IngestProtocolDouble() as double:
        with pytest.raises(BadInput, match=r"20 bad records in micro-batch 0; more than --max-bad-records 5"):
            run_feed(spark, replace(opts, port=double.port))
    assert not (tmp_path / "dead").exists()


def test_metrics_file_after_a_run(spark, tmp_path):
    with IngestProtocolDouble() as double:
        opts = FeedOptions(source="rate", rows_per_second=100, topics=2, trigger_seconds=0.5, max_seconds=5,
                           by_topic=True, port=double.port, admin_url=None, checkpoint=str(tmp_path / "ck"),
                           metrics_file=str(tmp_path / "f.prom"))  # fmt: skip
        stats = run_feed(spark, opts)
    text = (tmp_path / "f.prom").read_text()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert values['fanout_feed_records_total{outcome="delivered"}'] == str(stats.delivered) != "0"
    assert values["fanout_feed_batches_total"] == str(stats.batches) and values["fanout_feed_up"] == "0"
    assert float(values["fanout_feed_publish_seconds"]) > 0
    assert 0 < float(values["fanout_feed_event_time_lag_seconds"]) < 60  # the wall-clock rate source: now
    # Spark's own figures, from the query's progress (a StreamingQueryListener)
    assert float(values["fanout_feed_processed_rows_per_second"]) > 0
    assert float(values["fanout_feed_batch_duration_seconds"]) > 0
    assert orjson.dumps(values)  # every value is one token
