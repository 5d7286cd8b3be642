"""The short form of the chaos run (docs/reliability.md): two gateway nodes on a real Redis, clients on every
transport, every fault of FAULTS once (~60 s: each next fault 1-2 s after every client was served again);
no violation of the invariant, every client served again after every fault, no traceback or ERROR in the
logs, bounded growth of RSS, descriptors and asyncio tasks over both nodes' last processes (40 s and more,
up to what is left once every client left)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loadtest import chaos
from tests.loadtest.chaos_checks import assert_served_again

if not (os.path.exists("/usr/bin/redis-server") or shutil.which("redis-server")):
    pytest.skip("redis-server is missing: `make redis` (part of `make test`) installs it", allow_module_level=True)

#: path-stall: a stalled path holds private entries in flight while the client gives the connection up;
#: fanout_client's acknowledged subscription gets them again (docs/reliability.md, "Findings");
#: redis-stall: Redis stopped (SIGSTOP) 3 s, publishes wait. Each runs once, in this order.
FAULTS = [
    "node-kill",
    "redis-restart",
    "slow-reader",
    "path-stall",
    "redis-stall",
    "storm",
    "redis-wipe",
    "burst",
    "path-cut",
    "takeover",
]


def test_chaos_short_form_no_violation_every_client_served_again_bounded_growth(tmp_path: Path) -> None:
    # the next fault 1-2 s after every client got a message published after the last one's end (at most 15 s:
    # the recovery bound below); 6 s of traffic after the last fault; `duration` only bounds the run. The
    # growth's last samples are taken once every client left (which node the clients ended on, after the
    # faults moved them, says nothing of a leak)
    result = chaos.run(
        duration=150.0,
        faults=FAULTS,
        out=tmp_path,
        seed=1,
        sample_s=2.0,
        warmup=5.0,
        rounds=1,
        settle_s=15.0,
        pause=(1.0, 2.0),
        tail_s=6.0,
        idle_samples=3,
    )
    print(chaos.report(result))
    assert result["check"]["violations"] == []
    assert [f["name"] for f in result["faults"]] == FAULTS
    # the private queues over SSE (acks POSTed) and long-poll got their messages (checked by the invariant)
    for client in ("sse-priv-u2", "lp-priv-u3"):
        assert result["check"]["streams"][client][chaos.PRIVATE]["messages"] > 0, client
    assert_served_again(result)
    assert (tmp_path / "chaos.json").stat().st_size > 0
    # growth over 40 s and more: node A's process, and node B's from 5 s after its restart (the first fault)
    grown = {process: g for process, g in result["growth"].items() if process.startswith("node") and g["span_s"] >= 40}
    assert {process.split()[0] for process in grown} == {"node-a", "node-b"}, result["growth"]
    for process, g in grown.items():
        assert g["rss"]["growth_pct"] <= 10.0, (process, g)
        assert g["fds"]["end"] <= g["fds"]["start"] * 1.1 + 15, (process, g)
        if "tasks" in g:  # asyncio tasks: connections and their timers come and go, they do not pile up
            assert g["tasks"]["end"] <= g["tasks"]["start"] * 1.1 + 15, (process, g)
