"""The short form of the chaos run (docs/reliability.md): two gateway nodes on a real Redis, clients on every
transport, every fault of FAULTS once (~35 s: each next fault 0.2-0.5 s after every client was served
again); no violation of the invariant, every client served again after every fault, no traceback or ERROR in
the logs, bounded growth of RSS, descriptors and asyncio tasks over both nodes' last processes (over every
fault, up to what is left once every client left)."""

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


#: seconds: the warm-up (before the first fault, and of each process's growth) and between samples
WARMUP, SAMPLE_S = 2.0, 1.0


def test_chaos_short_form_no_violation_every_client_served_again_bounded_growth(tmp_path: Path) -> None:
    # the next fault 0.2-0.5 s after every client got a message published after the last one's end (at most
    # 15 s: the recovery bound below), so the faults still follow one another, each on a recovered cluster;
    # 2 s of traffic after the last fault; `duration` only bounds the run. The slow reader stops 5 s (past
    # `blocked_timeout_s` 4, as the soak's 8 s). The growth's last samples are taken once every client left
    # (which node the clients ended on, after the faults moved them, says nothing of a leak)
    result = chaos.run(
        duration=150.0,
        faults=FAULTS,
        out=tmp_path,
        seed=1,
        sample_s=SAMPLE_S,
        warmup=WARMUP,
        rounds=1,
        settle_s=15.0,
        pause=(0.2, 0.5),
        tail_s=2.0,
        idle_samples=3,
        slow_reader_s=5.0,
    )
    print(chaos.report(result))
    assert result["check"]["violations"] == []
    assert [f["name"] for f in result["faults"]] == FAULTS
    # the private queues over SSE (acks POSTed) and long-poll got their messages (checked by the invariant)
    for client in ("sse-priv-u2", "lp-priv-u3"):
        assert result["check"]["streams"][client][chaos.PRIVATE]["messages"] > 0, client
    assert_served_again(result)
    assert (tmp_path / "chaos.json").stat().st_size > 0
    # growth over every fault: node A's process, and node B's from its warm-up after its restart (the first
    # fault) to past the last fault (its first sample after the restart comes within a sample or two)
    faults = result["faults"]
    span = faults[-1]["healed"] - faults[0]["healed"] - WARMUP - 3 * SAMPLE_S
    grown = {p: g for p, g in result["growth"].items() if p.startswith("node") and g["span_s"] >= span}
    assert {process.split()[0] for process in grown} == {"node-a", "node-b"}, (span, result["growth"])
    for process, g in grown.items():
        assert g["rss"]["growth_pct"] <= 10.0, (process, g)
        assert g["fds"]["end"] <= g["fds"]["start"] * 1.1 + 15, (process, g)
        if "tasks" in g:  # asyncio tasks: connections and their timers come and go, they do not pile up
            assert g["tasks"]["end"] <= g["tasks"]["start"] * 1.1 + 15, (process, g)
