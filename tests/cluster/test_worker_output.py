"""What `gateway serve` prints with `server.workers` = 2 (docs/cluster.md §5): the builds and the admin
token once, before any worker says it listens, each worker's own lines tagged with its number; and Redis
down at start ends the supervisor with status 2, the status of a gateway that could not start."""

from __future__ import annotations

import re

import pytest

from tests.cluster.cluster_helpers import Node


def test_two_workers_print_the_banner_once_the_token_first_and_tag_their_own_lines(nodes) -> None:
    node = nodes.start("w", server={"workers": 2, "admin_token": ""})
    assert node.stop() == 0
    lines = node.log().splitlines()
    assert len([line for line in lines if line.startswith("core: ")]) == 1, lines
    assert len([line for line in lines if line.startswith("fan-out writer: ")]) == 1, lines
    token = [i for i, line in enumerate(lines) if line.startswith("admin token (development")]
    listening = [i for i, line in enumerate(lines) if "listening on" in line]
    assert len(token) == 1 and len(listening) == 2 and token[0] < min(listening), lines
    assert sorted(re.sub(r" listening on .*", "", lines[i]) for i in listening) == ["gateway worker 0", "gateway worker 1"]


@pytest.mark.timeout(60)
def test_redis_down_at_start_ends_every_worker_and_the_supervisor_with_status_2(tmp_path) -> None:
    node = Node(tmp_path / "down", "redis://127.0.0.1:1/0", {"server": {"workers": 2}, "broker": {"connect_timeout_s": 1.0}})
    node.start(wait=False)
    assert node.proc is not None
    assert node.proc.wait(30) == 2, node.log()
    log = node.log()
    assert "unreachable after" in log and "ended with status -15" not in log, log
    assert re.search(r"^gateway worker [01]: broker redis://127\.0\.0\.1:1/0: unreachable after", log, re.M), log
