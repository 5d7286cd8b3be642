"""The live audit (issue 12, step 6): the gateway's sampled delivery log ([deliverylog], gateway/ops/deliverylog.py)
and ``audit --follow`` (pipeline/live.py) reading it with Structured Streaming while traffic flows."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import types

import pytest

from fanout_client.ingest import IngestConnection
from pipeline import reference
from pipeline.live import follow, window_figures
from tests.pipeline.test_pipeline_e2e import Subscriber, subscriber_socket

gateway_testing = pytest.importorskip("gateway.testing")

TOPICS = ["live.a", "live.b"]


def logged_gateway(directory, **extra):
    settings = {"enabled": True, "directory": str(directory), "sample_rate": 1.0, "flush_interval_s": 0.1,
                "rotate_s": 0.5, **extra}  # fmt: skip
    return gateway_testing.run_gateway(deliverylog=settings)


def publish_for(port: int, seconds: float, per_second: int = 200) -> int:
    """Publish to both topics at a steady rate; returns the messages per topic."""
    sent = 0
    started = time.monotonic()
    with IngestConnection(port=port) as ingest:
        while time.monotonic() - started < seconds:
            ingest.send(*({"topic": t, "seq": sent, "data": {"n": sent}} for t in TOPICS))
            sent += 1
            if sent % 20 == 0:
                ingest.sync(sent)
            time.sleep(max(0.0, started + sent / per_second - time.monotonic()))
        ingest.sync("end")
    return sent


def read_log(directory) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("deliveries-*.jsonl")) for line in path.open()]


def test_the_gateway_logs_what_it_delivers(tmp_path):
    with logged_gateway(tmp_path / "log") as gw, contextlib.ExitStack() as stack:
        clients = [Subscriber(stack.enter_context(subscriber_socket(gw.ws_url)), TOPICS) for _ in range(2)]
        sent = publish_for(gw.ingest_port, 1.0)
        for client in clients:
            client.wait_for({t: sent - 1 for t in TOPICS})
        time.sleep(0.5)
        hub = gw.hub
    hub.delivery_log._thread.join(10)  # the writer completes its last file once the hub stopped
    rows = read_log(tmp_path / "log")
    assert not list((tmp_path / "log").glob(".deliveries-*"))
    assert {r["transport"] for r in rows} == {"ws"} and len({r["client"] for r in rows}) == 2
    for client in {r["client"] for r in rows}:
        for topic in TOPICS:
            seqs = [r["seq"] for r in rows if r["client"] == client and r["topic"] == topic]
            assert seqs == list(range(sent))
    assert all(r["publish_ns"] is not None and 0 <= r["deliver_ns"] - r["publish_ns"] < 5e9 for r in rows)
    assert hub.delivery_log.dropped_batches == 0
    # the same figures as the batch audit's definitions
    report = reference.report([(r["topic"], r["seq"], r["client"], r["publish_ns"], r["deliver_ns"], r["batch_id"])
                               for r in rows])  # fmt: skip
    assert report["loss"]["missing"] == 0 and report["clients"] == 2


def test_sampling_is_per_client(tmp_path):
    from gateway.ops.deliverylog import DeliveryLog

    config = types.SimpleNamespace(sample_rate=0.25, directory=str(tmp_path), rotate_s=60, rotate_bytes=1 << 20,
                                   max_files=3, flush_interval_s=60, max_queue=10, max_publish_stamps=10)  # fmt: skip
    log = DeliveryLog(config, "x")
    conn = types.SimpleNamespace(identity=types.SimpleNamespace(transport="lp"))
    chosen = [log._sample(f"client-{i}", conn) == "lp" for i in range(4000)]
    assert 0.2 < sum(chosen) / 4000 < 0.3
    assert [log._sample(f"client-{i}", conn) == "lp" for i in range(4000)] == chosen  # stable
    for _ in range(20):
        log.delivered(types.SimpleNamespace(client_id=f"client-{chosen.index(True)}", entries=[]), conn)
    assert len(log._queue) == 10 and log.dropped_batches == 10  # bounded, never waits
    log.close()


def test_window_figures_match_the_batch_definitions():
    rows = [("t", s, c, 1_000 * s, 1_000 * s + 50 + 10 * i, 0) for s in range(10) for i, c in enumerate("ab")]
    rows.append(("t", 99, "a", None, 5, 0))
    got = window_figures(0, 10_000, rows)
    assert got["rows"] == 21 and got["unstamped"] == 1 and got["clients"] == 2
    assert got["skew_ns"]["max"] == 10 and got["loss"]["rate"] == 0.0 and got["fairness"]["jain"] == 1.0
    assert got["cold_topics"]["topics"] == ["t"] and got["latency_ns"]["max"] == 60


@pytest.mark.spark
def test_follow_writes_windowed_figures_while_traffic_flows(spark, tmp_path):
    out = tmp_path / "out"
    result: dict = {}
    with logged_gateway(tmp_path / "log") as gw, contextlib.ExitStack() as stack:
        for _ in range(2):
            Subscriber(stack.enter_context(subscriber_socket(gw.ws_url)), TOPICS)

        def run() -> None:
            try:
                result["stats"] = follow(spark, str(tmp_path / "log"), str(out), window_s=1, watermark_s=0.5,
                                         trigger_seconds=0.5, max_seconds=10)  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        publish_for(gw.ingest_port, 6.0, per_second=100)
        thread.join(60)
    assert "error" not in result, result.get("error")
    stats = result["stats"]
    windows = [json.loads(line) for line in (out / "windows.jsonl").read_text().splitlines()]
    assert stats.windows == len(windows) >= 2
    full = [w for w in windows if w["rows"] > 0]
    assert all(w["clients"] == 2 and w["topics"] == 2 for w in full)
    assert all(w["loss"]["missing"] == 0 and w["unstamped"] == 0 for w in full)
    assert json.loads((out / "latest.json").read_text()) == windows[-1]
    delays = [(written - end) / 1e9 for end, written in stats.written]
    assert all(0 < d < 10 for d in delays), delays  # watermark + file rotation + trigger + the batch
