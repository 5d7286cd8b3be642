"""audit: the figures on a hand-made delivery log are exactly right (Spark with --exact and the pure-Python
reference alike), and the Spark job agrees with the reference on a larger random log."""

from __future__ import annotations

import json
import random
import statistics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import figures, reference

COLUMNS = list(figures.DELIVERY_LOG_COLUMNS)
ARROW_SCHEMA = pa.schema(
    [(name, pa.string() if t == "string" else pa.int64()) for name, t in figures.DELIVERY_LOG_COLUMNS.items()]
)


def hand_log() -> list[dict]:
    """A log whose figures are worked out by hand below.

    topic a: seqs 0..4 published at 0, 100, 200, 300, 1300 (largest publish gap 1000).
      c1 gets all, latency 10.  c2 gets all, latency 20 except seq 1 (500).  c3 loses seqs 2 and 3, latency 30.
    topic b: seqs 10..12 published at 50, 60, 70 (gap 10).
      c1 gets all, latency 5.  c2 joins late: seqs 11, 12, latency 7.  c3 gets seq 10 only, latency 100.
    """
    publish = {("a", 0): 0, ("a", 1): 100, ("a", 2): 200, ("a", 3): 300, ("a", 4): 1300,
               ("b", 10): 50, ("b", 11): 60, ("b", 12): 70}  # fmt: skip
    got = [
        ("c1", "a", [0, 1, 2, 3, 4], lambda s: 10),
        ("c2", "a", [0, 1, 2, 3, 4], lambda s: 500 if s == 1 else 20),
        ("c3", "a", [0, 1, 4], lambda s: 30),
        ("c1", "b", [10, 11, 12], lambda s: 5),
        ("c2", "b", [11, 12], lambda s: 7),
        ("c3", "b", [10], lambda s: 100),
    ]
    rows = []
    for batch, (client, topic, seqs, latency) in enumerate(got):
        for seq in seqs:
            p = publish[(topic, seq)]
            rows.append(dict(topic=topic, seq=seq, client=client, publish_ns=p, deliver_ns=p + latency(seq), batch_id=batch))
    return rows


def write_log(rows: list[dict], path) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), path)
    return str(path)


def check_hand_figures(report: dict) -> None:
    approx = pytest.approx
    assert report["rows"] == 19 and report["topics"] == 2 and report["clients"] == 3
    # latency a: [10 x5, 20 x4, 30 x3, 500]; b: [5, 5, 5, 7, 7, 100]
    assert report["latency_ns"]["a"] == {"count": 13, "p50": 20.0, "p90": 30.0, "p99": approx(443.6), "max": 500}
    assert report["latency_ns"]["b"] == {"count": 6, "p50": 6.0, "p90": approx(53.5), "p99": approx(95.35), "max": 100}
    # skews a: [20, 490, 10, 10, 20]; b: [95, 2, 2]
    skew = report["skew_ns"]
    assert {k: skew[k] for k in ("messages", "p50", "p99", "max")} == {
        "messages": 8, "p50": 15.0, "p99": approx(462.35), "max": 490,
    }  # fmt: skip
    assert skew["by_topic"]["a"] == {"messages": 5, "p50": 20.0, "p99": approx(471.2), "max": 490}
    assert skew["by_topic"]["b"] == {"messages": 3, "p50": 2.0, "p99": approx(93.14), "max": 95}
    # loss: only c3 on a misses 2 of 5; expected 5+5+5+3+2+1
    assert report["loss"]["expected"] == 21 and report["loss"]["missing"] == 2
    assert report["loss"]["rate"] == approx(2 / 21)
    assert report["loss"]["worst"] == [{"client": "c3", "topic": "a", "expected": 5, "missing": 2, "rate": 0.4}]
    # starvation: c3 on a waited 1200 ns (130 -> 1330) while the topic's longest silence was 1000
    starvation = report["starvation"]
    assert starvation["pairs"] == 6 and starvation["max_excess_ns"] == 200
    assert starvation["worst"][0] == {
        "client": "c3", "topic": "a", "max_deliver_gap_ns": 1200, "max_publish_gap_ns": 1000, "excess_ns": 200,
    }  # fmt: skip
    excess = {(w["client"], w["topic"]): w["excess_ns"] for w in starvation["worst"]}
    assert excess == {("c3", "a"): 200, ("c1", "a"): 0, ("c1", "b"): 0, ("c2", "b"): 0, ("c3", "b"): -10, ("c2", "a"): -280}
    # every client's span is 1300 ns, so the rates are proportional to 8, 7, 4 deliveries
    assert report["fairness"]["clients_with_rate"] == 3
    assert report["fairness"]["jain"] == approx(19**2 / (3 * (8**2 + 7**2 + 4**2)))
    assert report["fairness"]["max_rate_per_s"] == approx(8 / 1300e-9)


def assert_reports_match(got: dict, want: dict) -> None:
    """Equal, floats to 1e-9 relative (Spark's and Python's interpolation may differ in the last bit)."""
    assert json.loads(json.dumps(got)) == _approx_tree(json.loads(json.dumps(want)))


def _approx_tree(value):
    if isinstance(value, dict):
        return {k: _approx_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_approx_tree(v) for v in value]
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-9)
    return value


# -- pure definitions, no Spark ---------------------------------------------------------------------------


def test_reference_gets_the_hand_figures():
    check_hand_figures(reference.report(hand_log()))


def test_reference_takes_tuples_in_column_order():
    rows = hand_log()
    assert reference.report([tuple(r[c] for c in COLUMNS) for r in rows]) == reference.report(rows)


@given(st.lists(st.integers(-(10**12), 10**12), min_size=2, max_size=60))
def test_percentile_matches_statistics_inclusive(values):
    values.sort()
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for p in (1, 50, 90, 99):
        assert figures.percentile(values, p / 100) == pytest.approx(cuts[p - 1], rel=1e-9, abs=1e-3)


@given(st.lists(st.floats(0, 1e9), min_size=1, max_size=40))
def test_jain_is_between_one_over_n_and_one(xs):
    j = figures.jain(xs)
    if not any(xs):
        assert j is None
    else:
        assert 1 / len(xs) - 1e-9 <= j <= 1 + 1e-9


def test_figure_edge_cases():
    assert figures.percentile([], 0.5) is None
    assert figures.largest_gap([5]) == 0 and figures.largest_gap([1, 4, 6]) == 3
    assert figures.jain([3, 3, 3]) == 1.0 and figures.jain([1, 0, 0, 0]) == 0.25


# -- the Spark job ----------------------------------------------------------------------------------------


@pytest.mark.spark
def test_audit_exact_on_the_hand_log(spark, tmp_path):
    from pipeline.audit import audit

    log = write_log(hand_log(), tmp_path / "log.parquet")
    report = audit(spark, log, str(tmp_path / "out"), exact=True)
    check_hand_figures(report)
    assert report["percentiles"]["method"] == "exact"
    assert_reports_match(report, reference.report(hand_log()))
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == json.loads(json.dumps(report))
    pairs = pq.read_table(tmp_path / "out" / "pairs").to_pylist()
    assert len(pairs) == 6
    c3a = next(p for p in pairs if (p["client"], p["topic"]) == ("c3", "a"))
    assert (c3a["missing"], c3a["expected"], c3a["excess_ns"]) == (2, 5, 200)
    latency = {r["topic"]: r for r in pq.read_table(tmp_path / "out" / "latency_by_topic").to_pylist()}
    assert latency["b"]["p50"] == 6.0 and latency["a"]["max"] == 500
    assert len(pq.read_table(tmp_path / "out" / "clients")) == 3
    assert len(pq.read_table(tmp_path / "out" / "skew_by_topic")) == 2


@pytest.mark.spark
def test_audit_approximate_keeps_the_exact_figures_exact(spark, tmp_path):
    from pipeline.audit import audit

    log = write_log(hand_log(), tmp_path / "log.parquet")
    report = audit(spark, log, str(tmp_path / "out"), accuracy=1000)
    assert report["percentiles"] == {
        "method": "approximate", "function": "percentile_approx", "accuracy": 1000, "max_rank_error": "n/1000",
    }  # fmt: skip
    want = reference.report(hand_log())
    for key in ("loss", "starvation", "fairness"):
        assert_reports_match(report[key], want[key])
    assert report["latency_ns"]["a"]["max"] == 500 and report["latency_ns"]["a"]["count"] == 13
    # percentile_approx answers actual values: the p50 of a is the 7th smallest of 13
    assert report["latency_ns"]["a"]["p50"] == 20.0


def random_log(seed: int, clients: int = 5, topics: int = 3, messages: int = 120) -> list[dict]:
    """Deliveries with random latencies, losses, late joins, duplicates and ties."""
    rng = random.Random(seed)
    rows = []
    for t in range(topics):
        publish = 0
        published = []
        for seq in range(messages):
            publish += rng.choice([0, 1, 5, 50, 400])
            published.append((seq, publish))
        for c in range(clients):
            start = rng.randrange(messages // 3)
            for seq, p in published[start:]:
                if rng.random() < 0.05:
                    continue  # lost
                copies = 2 if rng.random() < 0.01 else 1
                for _ in range(copies):
                    rows.append(dict(topic=f"t{t}", seq=seq, client=f"c{c}", publish_ns=p,
                                     deliver_ns=p + rng.randrange(1, 2000), batch_id=rng.randrange(10)))  # fmt: skip
    rng.shuffle(rows)
    return rows


@pytest.mark.spark
def test_audit_exact_matches_the_reference_on_a_random_log(spark, tmp_path):
    from pipeline.audit import audit

    rows = random_log(seed=4)
    log = write_log(rows, tmp_path / "log.parquet")
    report = audit(spark, log, str(tmp_path / "out"), exact=True)
    want = reference.report(rows)
    assert want["loss"]["missing"] > 0 and want["rows"] == len(rows)
    assert_reports_match(report, want)
