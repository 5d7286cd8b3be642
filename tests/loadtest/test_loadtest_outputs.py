"""The files of a run: the Parquet delivery log (exact schema, round trip), the plots and the HTML report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from loadtest import analysis, deliverylog, report
from loadtest import delivery_stats as metrics
from loadtest.scenarios import Scenario
from tests.loadtest import loadtest_known as known

pytestmark = pytest.mark.unit

EXPECTED_SCHEMA = [
    ("topic", pa.string()),
    ("seq", pa.int64()),
    ("client", pa.string()),
    ("publish_ns", pa.int64()),
    ("deliver_ns", pa.int64()),
    ("batch_id", pa.int64()),
]


def test_parquet_schema_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "deliveries.parquet"
    deliverylog.write(path, known.log())
    schema = pq.read_schema(path)
    assert [(f.name, f.type) for f in schema] == EXPECTED_SCHEMA
    table = pq.read_table(path)
    assert table.num_rows == len(known.log())
    assert table.column("topic").to_pylist()[:6] == ["a"] * 5 + ["b"]
    assert table.column("client").to_pylist()[-1] == "c2"


def test_parquet_round_trip_keeps_every_figure(tmp_path: Path) -> None:
    path = tmp_path / "deliveries.parquet"
    original = known.log()
    deliverylog.write(path, original)
    back = deliverylog.read(path)
    names = lambda log, codes, table: [table[c] for c in codes]  # noqa: E731
    assert names(back, back.topic, back.topics) == names(original, original.topic, original.topics)
    assert names(back, back.client, back.clients) == names(original, original.client, original.clients)
    for column in ("seq", "publish_ns", "deliver_ns", "batch_id"):
        assert np.array_equal(getattr(back, column), getattr(original, column))
    assert sorted(metrics.skews(back).tolist()) == sorted(metrics.skews(original).tolist())
    assert np.array_equal(np.sort(metrics.latencies(back)), np.sort(metrics.latencies(original)))


def test_empty_log_round_trips(tmp_path: Path) -> None:
    empty = known.log().select(np.zeros(len(known.log()), bool))
    deliverylog.write(tmp_path / "empty.parquet", empty)
    assert len(deliverylog.read(tmp_path / "empty.parquet")) == 0


def _summary() -> dict:
    worker = {"frames": 12, "dropped_rows": 0, "foreign": 0, "errors": {}, "error_samples": []}
    clients = {i: {"ready": True, "closed_ns": 0, "error": "", "closed_reason": ""} for i in range(3)}
    published = {"sent": 10, "accepted": known.PUBLISHED, "first_ns": 1_000 * known.MS, "last_ns": 2_000 * known.MS}
    data = analysis.RunData(known.log(), known.notices(), known.STARTS, clients, published, [worker])
    return analysis.summarize(
        data, Scenario("known", clients=3, topics=2, subs=1), known.plan(), "gateway", 1_000 * known.MS, False
    )


def test_report_and_plots_are_written(tmp_path: Path) -> None:
    summary = _summary()
    report.write(tmp_path, known.log(), summary, known.plan(), 1_000 * known.MS)
    for name in report.PLOTS:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG"), name
        assert len(data) > 5_000, name
    page = (tmp_path / "report.html").read_text()
    for name in report.PLOTS:
        assert f'src="{name}"' in page
    assert "silent loss" in page
    topics = json.loads((tmp_path / "topics.json").read_text())
    assert topics["a"]["class"] == "hot" and topics["a"]["n"] == 13


def test_summary_and_comparison_tables_print() -> None:
    console = Console(record=True, width=120)
    summary = _summary()
    report.print_summary(console, summary, "known")
    report.print_comparison(console, {"gateway": analysis.figures(summary), "nchan": analysis.figures(summary)}, "known vs known")
    text = console.export_text()
    assert "silent loss" in text and "gateway/nchan" in text and "1.00" in text


def test_overlay_of_two_runs(tmp_path: Path) -> None:
    deliverylog.write(tmp_path / "a.parquet", known.log())
    report.write_overlay(tmp_path / "overlay.png", {"a": tmp_path / "a.parquet", "gone": tmp_path / "missing"})
    assert (tmp_path / "overlay.png").read_bytes().startswith(b"\x89PNG")
