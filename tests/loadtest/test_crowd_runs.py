"""The crowd scenarios end to end, small: the gateway as shipped with clients over many source addresses, a
reconnect storm, the comparison with nchan and the bare server (when nchan is installed) and two workers on
Redis (when redis-server is installed). Seconds each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rich.console import Console

from loadtest import analysis, nchan, runner
from loadtest.gatewayproc import GatewayProcess
from loadtest.redisproc import redis_binary
from loadtest.scenarios import SCENARIOS, Scenario

#: 300 clients over 10 addresses (30 each, under the shipped 256 per address), one topic at 5 msgs/s
SMALL_CROWD = dataclasses.replace(SCENARIOS["crowd"], clients=300, source_addrs=10, duration=3, drain=3)


def _run(scenario: Scenario, out: Path, workers: int = 1) -> dict:
    return runner.run(
        scenario,
        lambda workdir: GatewayProcess(workdir, shipped=True, workers=workers),
        out,
        Console(record=True, width=140),
        progress=False,
        connect_timeout=15,
    )


def _no_loss(summary: dict) -> None:
    assert summary["clients"]["ready"] == summary["clients"]["planned"]
    assert summary["clients"]["closed_during_run"] == 0
    loss = summary["loss"]
    assert (loss["silent"], loss["announced"], loss["undelivered"], loss["duplicates"]) == (0, 0, 0, 0)
    assert summary["deliveries"]["total"] == summary["published"]["accepted"] * summary["clients"]["planned"] > 0


def test_crowd_over_source_addresses_and_a_reconnect_storm_against_the_shipped_gateway(tmp_path: Path) -> None:
    # one run for both (each paid the gateway's and the load processes' start): the crowd's figures, then
    # its storm at 1 s, every client back within 1 s, resubscribing with `since`
    scenario = dataclasses.replace(SMALL_CROWD, storm_at=1.0, storm_spread=1.0)
    summary = _run(scenario, tmp_path)
    _no_loss(summary)
    assert "max_connections_per_ip" not in (tmp_path / "gateway.toml").read_text()  # the shipped 256 holds
    ttl = summary["time_to_last_ms"]
    assert ttl["n"] == summary["published"]["accepted"] and 0 < ttl["p50"] <= ttl["max"]
    assert ttl["max"] >= summary["latency_ms"]["max"] - 1e-6  # the last receiver of a publish is its slowest
    server = summary["cpu"]["server"]
    assert server["rss_connected_mb"] > 0 and server["rss_per_conn_kb"] == pytest.approx(
        (server["rss_connected_mb"] - server["rss_before_mb"]) * 1024 / 300, abs=0.4
    )  # MB rounded to 0.1
    figures = analysis.figures(summary)
    for name in (
        "time to last p50 ms",
        "time to last max ms",
        "server rss KB/conn",
        "server cpu us/delivery",
        "server cpu us/segment",
        "latency p99 ms",
        "storm last caught up s",
    ):
        assert name in figures
    storm = summary["storm"]
    assert storm["ok"], storm
    assert (storm["clients"], storm["back"], storm["resubscribes"], storm["since_mismatch"]) == (300, 300, 300, 0)
    # how soon is a figure the table prints (`fanout-loadtest run crowd --storm-at`): a busy machine took 5.08 s
    assert 0 < storm["last_back_s"] <= storm["last_caught_up_s"]
    assert storm["accept_per_s"]["peak_1s"] > 0 and storm["accept_per_s"]["mean"] > 0
    assert storm["replayed"] > 0  # messages published while clients were away came from the ring


def test_one_source_address_meets_the_shipped_per_address_limit(tmp_path: Path) -> None:
    scenario = dataclasses.replace(SMALL_CROWD, source_addrs=1, duration=1)
    summary = _run(scenario, tmp_path)
    assert summary["clients"]["ready"] == 256 and summary["clients"]["failed"] == 300 - 256


@pytest.mark.skipif(not nchan.installed(), reason="nginx + nchan not installed (compare installs them)")
def test_compare_crowd_with_nchan_and_the_bare_server(tmp_path: Path) -> None:
    from loadtest.bare_server import BareServer
    from loadtest.compare import compare

    scenario = dataclasses.replace(SMALL_CROWD, clients=200, duration=2)
    console = Console(record=True, width=160)
    result = compare(
        scenario,
        lambda workdir: GatewayProcess(workdir, shipped=True),
        tmp_path,
        1,
        console,
        False,
        others={"bare": lambda workdir: BareServer(workdir, 1)},
        connect_timeout=15,
    )
    assert result["targets"] == ["gateway", "nchan", "bare"]
    for label in result["targets"]:
        assert result["median"][label]["silent loss"] == 0
        assert result["median"][label]["deliveries/s"] > 0
    assert set(result["ratios"]) == {"gateway/nchan", "bare/nchan"}
    assert result["ratios"]["gateway/nchan"]["server rss KB/conn"] > 0
    text = console.export_text()
    assert "gateway/nchan" in text and "bare/nchan" in text and "time to last max ms" in text


@pytest.mark.skipif(redis_binary() is None, reason="redis-server not installed (make redis)")
def test_two_workers_on_redis_are_measured_as_one_server(tmp_path: Path) -> None:
    scenario = dataclasses.replace(SMALL_CROWD, clients=200, duration=2, workers=2)
    summary = _run(scenario, tmp_path, workers=2)
    _no_loss(summary)
    assert "workers = 2" in (tmp_path / "gateway.toml").read_text()
    assert summary["cpu"]["server"]["rss_before_mb"] > 0
    assert "broker" in summary["cpu"] and "broker cpu us/delivery" in analysis.figures(summary)
