"""Whole load runs, end to end, against the real gateway (`python -m gateway`). Small: a few clients, a few
hundred messages, seconds each."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from loadtest import runner
from loadtest.gatewayproc import GatewayProcess
from loadtest.scenarios import Scenario

SMALL = Scenario(
    "small",
    "test",
    clients=12,
    topics=6,
    subs=2,
    rate=300,
    duration=1.5,
    transport="mixed",
    stall_frac=0.25,
    stall_at=0.3,
    stall_for=0.6,
    drain=5,
    procs=2,
)


def _run(scenario: Scenario, out: Path, command: str | None) -> dict:
    console = Console(record=True, width=120)
    return runner.run(
        scenario,
        lambda workdir: GatewayProcess(workdir, command, scenario.capacity),
        out,
        console,
        progress=False,
        connect_timeout=10,
    )


def _owed(summary: dict, out: Path) -> int:
    """Messages owed to the clients (all still reading at the end): sum over their topics of accepted."""
    accepted = summary["published"]["accepted_per_topic"]
    clients = json.loads((out / "clients.json").read_text())
    return sum(accepted.get(t, 0) for c in clients for t in c["topics"])


def _check(summary: dict, out: Path, scenario: Scenario) -> None:
    assert summary["clients"]["ready"] == summary["clients"]["planned"]
    assert summary["clients"]["closed_during_run"] == 0
    assert summary["loss"]["silent"] == 0
    assert summary["loss"]["duplicates"] == 0
    assert summary["loss"]["undelivered"] == 0
    assert summary["published"]["sent"] == summary["published"]["accepted"] > 0
    assert summary["deliveries"]["total"] + summary["loss"]["announced"] == _owed(summary, out)
    assert 0 < summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"] <= summary["latency_ms"]["max"]
    assert summary["skew_ms"]["n"] > 0
    assert 0 < summary["fairness"]["jain_rate"] <= 1
    assert summary["batch_entries"]["mean"] >= 1
    # CPU comes in 10 ms clock ticks: a short run may honestly read 0; the arithmetic is tested on known input
    assert summary["cpu"]["server"]["cpu_s"] >= 0 and summary["cpu"]["loadgen"]["cpu_s"] >= 0
    assert [f.name for f in pq.read_schema(out / "deliveries.parquet")] == [
        "topic",
        "seq",
        "client",
        "publish_ns",
        "deliver_ns",
        "batch_id",
    ]
    for name in ("summary.json", "clients.json", "topics.json", "report.html", "latency_cdf.png"):
        assert (out / name).stat().st_size > 0, name


def test_mixed_run_with_stalls_against_the_gateway(tmp_path: Path) -> None:
    summary = _run(SMALL, tmp_path, None)
    _check(summary, tmp_path, SMALL)
    assert set(summary["latency_ms_by_transport"]) == {"ws", "longpoll"}


def test_dominator_run_through_the_admin_api(tmp_path: Path) -> None:
    scenario = Scenario(
        "dom",
        "test",
        clients=6,
        topics=4,
        subs=2,
        rate=200,
        duration=1.0,
        dominator_topics=5,
        dominator_rate=300,
        publish_via="admin",
        drain=3,
    )
    summary = _run(scenario, tmp_path, None)
    dom = summary["dominator"]
    assert dom["light_p99_ms_without"] > 0 and dom["light_p99_ms_with"] > 0
    assert summary["with"]["latency_ms_dominator"]["n"] > 0
    assert "latency_ms_dominator" not in summary["without"]
    for label in ("without", "with"):
        assert summary[label]["loss"]["silent"] == 0
        assert (tmp_path / label / "deliveries.parquet").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["dominator"] == dom


def test_a_gateway_that_dies_at_start_is_reported(tmp_path: Path) -> None:
    command = f"{sys.executable} -c 'import sys; print(\"boom\"); sys.exit(3)'"
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*boom"):
        _run(SMALL, tmp_path, command)


def test_nothing_listening_fails_fast(tmp_path: Path) -> None:
    import socket
    import time
    from contextlib import nullcontext

    from loadtest.target import Target

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="publisher could not start"):
        runner.run(
            SMALL,
            lambda workdir: nullcontext(Target("gateway", "127.0.0.1", port, port)),
            tmp_path,
            Console(record=True),
            progress=False,
        )
    assert time.monotonic() - start < 15


def test_gateway_cmd_runs_the_checkout_its_pythonpath_names(tmp_path: Path, monkeypatch) -> None:
    """An A/B of two checkouts: run from this one, the gateway must come from the one on PYTHONPATH."""
    repo = Path(__file__).resolve().parents[2]
    other = tmp_path / "other"
    for package in ("core", "gateway", "config"):
        shutil.copytree(repo / package, other / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(repo)  # where `python -m` would find this checkout's gateway first
    script = "import sys, gateway.cli; print('ran', gateway.cli.__file__, flush=True); sys.exit(gateway.cli.main(sys.argv[1:]))"
    command = f'env PYTHONPATH={other} {sys.executable} -c "{script}"'
    with GatewayProcess(tmp_path / "run", command):
        pass
    log = (tmp_path / "run" / "gateway.log").read_text()
    assert f"ran {other / 'gateway' / 'cli.py'}" in log
    assert "core: " in log


def test_books_over_deflate_and_deltas_arrive_intact_in_fewer_bytes(tmp_path: Path) -> None:
    """`--payload book --compression deflate --delta fossil`: every book the clients rebuild matches its
    checksum, and the wire carries a fraction of the whole books."""
    scenario = Scenario(
        "books",
        "test",
        clients=8,
        topics=2,
        subs=1,
        rate=100,
        duration=1.0,  # 100 books, every one rebuilt from its deltas and checked
        drain=5,
        payload="book",
        compression="deflate",
        delta="fossil",
    )
    summary = _run(scenario, tmp_path, None)
    _check(summary, tmp_path, scenario)
    assert summary["client_errors"] == {}  # no delta failed, no book corrupt
    whole = 1500  # a book's frame, uncompressed: ~1.55 KB
    assert 0 < summary["wire"]["per_delivery"] < whole * 0.25


def test_a_run_of_centrifugo_protocol_clients(tmp_path: Path) -> None:
    """`--protocol centrifugo`: the clients speak Centrifugo's protocol at /connection/websocket and are
    recorded as /ws clients are: every message once, in order, nothing lost; with `--compression deflate`
    they negotiate it as the SDKs do, and every book arrives intact in fewer bytes."""
    scenario = Scenario(
        "cf",
        "test",
        clients=8,
        topics=2,
        subs=2,
        rate=200,
        duration=1.0,  # 200 books on 2 topics
        drain=5,
        protocol="centrifugo",
        payload="book",
        compression="deflate",
    )
    summary = _run(scenario, tmp_path, None)
    _check(summary, tmp_path, scenario)
    assert summary["client_errors"] == {}
    whole = 1500  # a book's frame, uncompressed: ~1.55 KB
    assert 0 < summary["wire"]["per_delivery"] < whole * 0.5
