"""The benchmark additions of the load generator: batch depth, the target scenarios, the closed-loop
publisher, cold/hot pairs, CPU accounting beyond our processes."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from loadtest import analysis, procstat, runner, scenarios
from loadtest.gatewayproc import GatewayProcess, config_text
from loadtest.publisher import Publisher, PublisherSpec
from loadtest.target import Target
from loadtest.worker import COUNTERS


def _parse(*argv: str) -> scenarios.Scenario:
    parser = argparse.ArgumentParser()
    scenarios.add_arguments(parser)
    return scenarios.from_args(parser.parse_args(list(argv)))


def test_target_scenarios_are_shaped_as_the_targets_say() -> None:
    one, spread, steady = (scenarios.SCENARIOS[n] for n in ("onetopic", "spread", "steady200"))
    assert (one.clients, one.topics, one.subs, one.rate) == (1000, 1, 1, None) and one.window > 0
    assert (spread.clients, spread.topics, spread.subs, spread.rate) == (1000, 100, 4, None)
    assert (steady.clients, steady.topics, steady.rate) == (1000, 1, 200)
    cold = scenarios.SCENARIOS["coldhot"]
    assert cold.coldhot and cold.hot_topics == 1
    for s in (one, spread, steady, cold):
        assert s.duration <= 10 and s.payload == scenarios.PAYLOAD_100


def test_hundred_byte_payload() -> None:
    from loadtest.publisher import Messages

    m = Messages(("t0000",), (1.0,), scenarios.PAYLOAD_100)
    assert len(m.data(0, 12345)) == 100


def test_batch_depth_and_window_flags() -> None:
    s = _parse("onetopic", "--batch-depth", "8", "--window", "16")
    assert (s.batch_depth, s.window) == (8, 16)
    assert _parse("smoke").batch_depth == 1
    with pytest.raises(ValueError):
        _parse("smoke", "--batch-depth", "0")
    with pytest.raises(ValueError):
        _parse("smoke", "--window", "-1")


def test_batch_depth_reaches_the_gateway_config(tmp_path: Path) -> None:
    assert "batch_depth = 8\n" in config_text("tok", 64, 8)
    assert "batch_depth = 1\n" in config_text("tok")
    assert GatewayProcess(tmp_path, None, 64, 8).batch_depth == 8


def test_coldhot_needs_hot_topics() -> None:
    with pytest.raises(ValueError):
        scenarios.Scenario("x", clients=4, topics=4, subs=2, coldhot=True).validate()


def test_silent_hot_topics_keep_the_cold_rates() -> None:
    s = scenarios.SCENARIOS["coldhot"]
    beside, alone = scenarios.plan(s), scenarios.plan(dataclasses.replace(s, hot_silent=True))
    assert alone.clients == beside.clients  # the same clients on the same topics
    for cls, r_alone, r_beside in zip(beside.classes, alone.rates, beside.rates):
        assert r_alone == (0.0 if cls == "hot" else r_beside)
    assert sum(r for r, c in zip(beside.rates, beside.classes) if c == "hot") == pytest.approx(s.rate * s.hot_share)  # type: ignore[operator]


def _closed_loop(window: int, fanout: int, deliver: bool, duration: float = 0.3) -> tuple[Publisher, int]:
    """A closed-loop publisher whose sends are counted; ``deliver``: the clients receive at once."""
    counters = [0] * len(COUNTERS)
    spec = PublisherSpec(
        Target("gateway", "127.0.0.1", 1, 2),
        ("a",),
        (1.0,),
        False,
        duration,
        10**9,
        0,
        window=window * fanout,
        fanout=(fanout,),
        procs=1,
    )
    pub = Publisher(spec, deliveries=counters)
    sent = []

    async def send(topics: list[int]) -> None:
        sent.extend(topics)
        if deliver:
            counters[COUNTERS.index("msgs_light")] += fanout * len(topics)

    pub.send = send
    asyncio.run(pub.run(time.time_ns()))
    return pub, len(sent)


def test_closed_loop_keeps_the_window() -> None:
    pub, sent = _closed_loop(window=8, fanout=100, deliver=False)
    assert sent == 8 and pub.window_resets == 0  # nothing came back: the window stays full
    _pub, sent = _closed_loop(window=8, fanout=100, deliver=True)
    assert sent > 100  # everything comes back at once: it keeps publishing


def test_closed_loop_forgives_a_stuck_window() -> None:
    pub, sent = _closed_loop(window=4, fanout=10, deliver=False, duration=1.3)
    assert pub.window_resets >= 2 and sent >= 12


def test_figures_of_a_coldhot_pair() -> None:
    base = _summary()
    pair = {"coldhot": {"cold_p99_ms_alone": 2.0, "cold_p99_ms_beside": 3.0, "p99_ratio": 1.5}, "alone": base, "beside": base}
    figures = analysis.figures(pair)
    assert figures["cold p99 beside/alone"] == 1.5 and figures["cold p99 ms alone"] == 2.0
    assert figures["server cpu us/delivery"] == pytest.approx(2e6 / 1000)
    assert figures["publisher cpu %"] == 5.0 and figures["other cpu % (not ours)"] == 1.5


def test_figures_of_server_segments() -> None:
    figures = analysis.figures(_summary())
    assert figures["server segments/delivery"] == 0.0 and figures["server cpu us/segment"] == 0.0  # not measured
    figures = analysis.figures({**_summary(), "server_segments": 250})
    assert figures["server segments/delivery"] == 0.25 and figures["server cpu us/segment"] == 8000.0


def _summary() -> dict:
    return {
        "deliveries": {"per_s": 100.0, "total": 1000},
        "published": {"per_s": 10.0},
        "latency_ms": {"p50": 1, "p90": 2, "p99": 3, "max": 4},
        "skew_ms": {"p50": 1, "p99": 2},
        "loss": {"announced": 0, "silent": 0, "undelivered": 0},
        "fairness": {"jain_rate": 1.0, "jain_share": 1.0},
        "batch_entries": {"mean": 1.0},
        "cpu": {
            "server": {"cpu_pct": 50.0, "cpu_s": 2.0, "rss_max_mb": 10.0},
            "loadgen": {"cpu_pct": 40.0, "cpu_s": 1.0, "busiest_pct": 30.0, "by_role_pct": {"publisher": 5.0, "clients": 30.0}},
            "machine": {"busy_pct": 91.5, "other_pct": 1.5},
        },
    }


def test_machine_cpu_and_wait_quiet() -> None:
    assert procstat.machine_cpu() > 0
    start = time.monotonic()
    assert procstat.wait_quiet(0.0, threshold_pct=1e9, period_s=0.05)[0]
    quiet, busy = procstat.wait_quiet(0.0, threshold_pct=-1, period_s=0.05)
    assert not quiet and busy >= 0 and time.monotonic() - start < 2


def test_coldhot_run_against_the_gateway(tmp_path: Path) -> None:
    scenario = scenarios.Scenario(
        "ch", "test", clients=6, topics=4, subs=2, rate=200, hot_topics=1, hot_share=0.8, coldhot=True, duration=1.0, drain=3
    )
    summary = runner.run(
        scenario,
        lambda workdir: GatewayProcess(workdir),
        tmp_path,
        Console(record=True, width=140),
        progress=False,
        connect_timeout=10,
    )
    pair = summary["coldhot"]
    assert pair["cold_p99_ms_alone"] > 0 and pair["cold_p99_ms_beside"] > 0 and pair["p99_ratio"] > 0
    assert "hot" not in summary["alone"]["topic_classes_ms"]  # silent: nothing delivered on it
    assert summary["beside"]["topic_classes_ms"]["hot"]["n"] > 0
    for label in ("alone", "beside"):
        assert summary[label]["loss"]["silent"] == 0
        assert (tmp_path / label / "deliveries.parquet").exists()
        # CPU is sampled in clock ticks (10 ms): a 1 s run of 6 clients may honestly read 0
        assert summary[label]["cpu"]["machine"]["busy_pct"] >= 0
        assert set(summary[label]["cpu"]["loadgen"]["by_role_pct"]) >= {"clients", "publisher"}


def test_closed_loop_run_against_the_gateway(tmp_path: Path) -> None:
    scenario = scenarios.Scenario("cl", "test", clients=8, topics=2, subs=1, rate=None, window=8, duration=1.0, drain=3, procs=2)
    summary = runner.run(
        scenario,
        lambda workdir: GatewayProcess(workdir),
        tmp_path,
        Console(record=True, width=140),
        progress=False,
        connect_timeout=10,
    )
    assert summary["loss"]["silent"] == 0 and summary["loss"]["announced"] == 0
    assert summary["published"]["sent"] > 16
    assert "window_resets" not in summary["published"]["errors"]


def test_idle_memory_measures_each_crowd_in_turn() -> None:
    from loadtest import idle_memory

    result = asyncio.run(idle_memory.measure(150, settle_s=0.5, crowds=2, hold_s=0.5, warm_s=0.5))
    assert result["clients"] == 150 and result["bytes_per_client"] > 0
    assert [run["rss_after_mb"] for run in result["crowds"]][0] == result["rss_after_mb"]
    assert len(result["crowds"]) == 2
    for run in result["crowds"]:
        assert run["rss_with_clients_mb"] > result["rss_before_mb"] > 0 and run["rss_after_mb"] > 0


def test_conn_objects_counts_what_one_idle_connection_holds() -> None:
    # in a fresh interpreter, as the command runs: in this one its walk of every object (all of pytest's
    # too) took three times as long; 0.1 s settles (not 0.5): the walk waits for the hub to count the crowd
    code = (
        "import asyncio, json; from loadtest import conn_objects; "
        "print(json.dumps(asyncio.run(conn_objects.measure(60, frames=5, top=40, settle_s=0.1))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["clients"] == 60 and result["traced_per_conn"] > 0 and result["sites"] and result["files"]
    walked = {name for name, _, _ in result["walk"]}
    assert {"WSConnection", "ClientIdentity", "Client", "Subscription"} <= walked
    # what an idle subscriber no longer holds (issue 27): a dict of uvicorn's protocol state, an asyncio Event
    # or Queue (deques), a loop timer, websockets' suspended frame parser
    assert not walked & {"deque", "TimerHandle", "Event", "Queue", "generator"}, walked
    assert result["walk_bytes"] < 4096


def test_comparison_warns_of_a_saturated_load_process() -> None:
    from rich.console import Console

    from loadtest.compare import _medians

    console = Console(record=True, width=200)
    runs = {
        "gateway": [{"loadgen busiest proc %": 40.0}, {"loadgen busiest proc %": 95.0}, {"loadgen busiest proc %": 50.0}],
        "nchan": [{"loadgen busiest proc %": 91.0}, {"loadgen busiest proc %": 96.0}, {"loadgen busiest proc %": 60.0}],
    }
    assert _medians(runs, console) == {"gateway": {"loadgen busiest proc %": 50.0}, "nchan": {"loadgen busiest proc %": 91.0}}
    text = console.export_text()
    assert "against nchan the busiest load process ran at 91%" in text and "against gateway" not in text
