"""The figures of a run, on a delivery log whose answers are known (tests/loadtest/loadtest_known.py)."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest import analysis
from loadtest import delivery_stats as metrics
from loadtest.delivery_stats import DeliveryLog, Notices
from tests.loadtest import loadtest_known as known

pytestmark = pytest.mark.unit


def test_latency_percentiles_are_nearest_rank() -> None:
    stats = metrics.ms(metrics.percentiles(metrics.latencies(known.log())))
    assert stats == pytest.approx(known.LATENCY_MS, abs=1e-3)


def test_percentiles_of_one_to_hundred() -> None:
    stats = metrics.percentiles(np.arange(1, 101))
    assert (stats["p50"], stats["p90"], stats["p99"], stats["max"]) == (50, 90, 99, 100)


def test_percentiles_of_nothing_are_zero() -> None:
    assert metrics.percentiles(np.zeros(0)) == {"n": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}


def test_rows_without_timestamp_have_no_latency() -> None:
    log = known.log()
    publish = log.publish_ns.copy()
    publish[0] = -1
    stripped = DeliveryLog(log.topics, log.clients, log.topic, log.seq, log.client, publish, log.deliver_ns, log.batch_id)
    assert metrics.latencies(stripped).size == len(log) - 1


def test_skew_per_message() -> None:
    assert sorted(metrics.skews(known.log()) / known.MS) == known.SKEW_MS
    stats = metrics.ms(metrics.percentiles(metrics.skews(known.log())))
    assert (stats["n"], stats["p50"], stats["p99"], stats["max"]) == (5, 4.0, 4.0, 4.0)


def test_skew_counts_a_client_once_at_its_first_delivery() -> None:
    # message (t0, 1) reaches c0 at 10 and again at 50, c1 at 20: skew 10, not 40
    log = DeliveryLog(
        ("t",),
        ("c0", "c1"),
        np.zeros(3, np.int32),
        np.ones(3, np.int64),
        np.array([0, 0, 1], np.int32),
        np.zeros(3, np.int64),
        np.array([10, 50, 20], np.int64),
        np.ones(3, np.int64),
    )
    assert metrics.skews(log).tolist() == [10]


def test_announced_and_silent_loss() -> None:
    figures = metrics.loss_figures(known.log(), known.notices(), known.STARTS, known.EXPECTED_END, {0, 1, 2})
    assert figures.delivered == 16
    assert figures.announced == 2  # [2,3) for c2 on a, [14,15) for c0 on b
    assert figures.silent == 2  # a:3 for c2, b:11 for c0
    assert figures.silent_gaps == 2
    assert figures.duplicates == 1  # b:12 twice for c0
    assert figures.undelivered == 1  # b:13 for c0 (14 is announced)
    assert figures.epoch_resets == 1
    assert figures.by_reason == {"lagged": 2, "epoch": 0}


def test_undelivered_only_counts_clients_still_reading() -> None:
    figures = metrics.loss_figures(known.log(), known.notices(), known.STARTS, known.EXPECTED_END, {1, 2})
    assert figures.undelivered == 0


def test_a_stream_that_skips_its_promised_start_is_silent_loss() -> None:
    # promised seq 0, first delivery 3 with nothing announced: 3 silent seqs
    log = DeliveryLog(
        ("t",),
        ("c",),
        np.zeros(2, np.int32),
        np.array([3, 4], np.int64),
        np.zeros(2, np.int32),
        np.zeros(2, np.int64),
        np.ones(2, np.int64),
        np.ones(2, np.int64),
    )
    figures = metrics.loss_figures(log, Notices.empty(), {(0, 0): 0})
    assert (figures.silent, figures.silent_gaps) == (3, 1)
    assert metrics.loss_figures(log, Notices.empty()).silent == 0  # no promise: starts at the first delivery


def test_a_client_subscribed_but_given_nothing_is_undelivered() -> None:
    figures = metrics.loss_figures(known.log(), Notices.empty(), {**known.STARTS, (2, 1): 10}, known.EXPECTED_END, {2})
    assert figures.undelivered == 5  # c2 on b: 10..14


def test_jain_index() -> None:
    assert metrics.jain(np.array([8, 5, 3])) == pytest.approx(known.JAIN)
    assert metrics.jain(np.array([4, 4, 4, 4])) == pytest.approx(1.0)
    assert metrics.jain(np.array([1, 0, 0, 0])) == pytest.approx(0.25)
    assert metrics.jain(np.zeros(0)) == 1.0
    counts = metrics.per_client_counts(known.log(), 3)
    assert counts.tolist() == [8, 5, 3]


def test_entries_per_batch() -> None:
    assert sorted(metrics.batch_sizes(known.log()).tolist()) == known.BATCH_SIZES
    stats = metrics.percentiles(metrics.batch_sizes(known.log()))
    assert stats["mean"] == pytest.approx(16 / 12)
    assert stats["max"] == 3


def test_rate_series() -> None:
    deliver = np.array([0, 50, 150, 160, 170], np.int64) * known.MS
    t, rate = metrics.rate_series(deliver, 0, 0.1)
    assert t.tolist() == pytest.approx([0.0, 0.1])
    assert rate.tolist() == pytest.approx([20.0, 30.0])


def test_per_topic_latency() -> None:
    per_topic = metrics.per_topic_latency(known.log())
    assert set(per_topic) == {"a", "b"}
    assert per_topic["b"]["n"] == 3 and per_topic["b"]["p99"] == 2 * known.MS
    assert per_topic["a"]["n"] == 13 and per_topic["a"]["max"] == 5 * known.MS


def _run_data() -> analysis.RunData:
    worker = {"frames": 12, "dropped_rows": 0, "foreign": 0, "errors": {}, "error_samples": []}
    clients = {i: {"ready": True, "closed_ns": 0, "error": "", "closed_reason": ""} for i in range(3)}
    published = {"sent": 10, "accepted": known.PUBLISHED, "first_ns": 1_000 * known.MS, "last_ns": 2_000 * known.MS}
    return analysis.RunData(known.log(), known.notices(), known.STARTS, clients, published, [worker])


def test_summary_figures() -> None:
    from loadtest.scenarios import Scenario

    summary = analysis.summarize(
        _run_data(), Scenario("known", clients=3, topics=2, subs=1), known.plan(), "gateway", 1_000 * known.MS, False
    )
    assert summary["latency_ms"] == pytest.approx(known.LATENCY_MS, abs=1e-3)
    assert summary["skew_ms"]["p50"] == 4.0
    assert summary["loss"]["silent"] == 2 and summary["loss"]["announced"] == 2
    assert summary["loss"]["undelivered"] == 1
    assert summary["fairness"]["jain_rate"] == pytest.approx(known.JAIN, abs=1e-4)
    # shares of what was published on their topics: c0 8/10, c1 5/5, c2 3/5
    shares = np.array([0.8, 1.0, 0.6])
    assert summary["fairness"]["jain_share"] == pytest.approx(metrics.jain(shares), abs=1e-4)
    assert summary["batch_entries"]["mean"] == pytest.approx(1.33)
    assert summary["topic_classes_ms"]["hot"]["n"] == 13  # topic a
    assert summary["latency_ms_by_transport"]["longpoll"]["p50"] == 5.0
    figures = analysis.figures(summary)
    assert figures["silent loss"] == 2 and figures["latency p50 ms"] == 2.0
