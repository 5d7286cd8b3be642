"""The nginx + nchan reference target: its config, and a small run against it when nchan is installed
(``python -m loadtest compare`` installs it; nothing here does)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from loadtest import nchan, runner
from loadtest.scenarios import Scenario


def test_config_renders_the_required_directives(tmp_path: Path) -> None:
    text = nchan.config_text(tmp_path, 4321, capacity=32)
    for needle in (
        "listen 127.0.0.1:4321",
        "worker_processes 1;",
        "nchan_subscriber websocket;",
        "nchan_subscriber_first_message newest;",
        'nchan_channel_id_split_delimiter ",";',
        'nchan_channel_id "$1";',
        "nchan_publisher http;",
        "nchan_message_buffer_length 32;",
        f"pid {tmp_path}/nginx.pid;",
        "location ~ ^/sub/(.+)$ {",
    ):
        assert needle in text, needle
    assert "$module" not in text and "$port" not in text


@pytest.mark.skipif(not nchan.installed(), reason="nginx + nchan not installed (compare installs them)")
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(nchan.config_text(tmp_path, nchan.free_port()))
    done = subprocess.run(
        [nchan.nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf)],  # type: ignore[list-item]
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(not nchan.installed(), reason="nginx + nchan not installed (compare installs them)")
def test_small_run_against_nchan(tmp_path: Path) -> None:
    scenario = Scenario("small", "test", clients=10, topics=5, subs=2, rate=200, duration=1.0, drain=3)
    summary = runner.run(
        scenario, lambda workdir: nchan.NchanServer(workdir), tmp_path, Console(record=True), progress=False, connect_timeout=10
    )
    assert summary["target"] == "nchan"
    assert summary["clients"]["ready"] == 10
    assert summary["loss"]["silent"] == 0 and summary["loss"]["undelivered"] == 0
    owed = sum(
        summary["published"]["accepted_per_topic"].get(t, 0)
        for c in json.loads((tmp_path / "clients.json").read_text())
        for t in c["topics"]
    )
    assert summary["deliveries"]["total"] == owed > 0
    assert summary["batch_entries"]["max"] == 1  # one message per frame
    assert summary["cpu"]["server"]["cpu_s"] >= 0  # 10 ms clock ticks: a short run may read 0


@pytest.mark.skipif(not nchan.installed(), reason="nginx + nchan not installed (compare installs them)")
def test_compare_the_gateway_with_nchan(tmp_path: Path) -> None:
    from loadtest.compare import compare
    from loadtest.gatewayproc import GatewayProcess

    scenario = Scenario("small", "test", clients=6, topics=4, subs=2, rate=200, duration=0.8, drain=3)
    console = Console(record=True, width=140)
    result = compare(scenario, lambda workdir: GatewayProcess(workdir), tmp_path, 1, console, False, connect_timeout=10)
    assert set(result["median"]) == {"gateway", "nchan"}
    assert result["median"]["nchan"]["silent loss"] == 0
    assert "gateway/nchan" in console.export_text()
    assert (tmp_path / "compare.json").exists() and (tmp_path / "compare_latency_cdf.png").exists()
