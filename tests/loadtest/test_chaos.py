"""The short form of the chaos run (docs/reliability.md): two gateway nodes on a real Redis, clients on every
transport, ~110 s with a subset of the faults in turn; no violation of the invariant, every client served
again after every fault, no traceback or ERROR in the logs, bounded growth of RSS, descriptors and asyncio tasks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loadtest import chaos

if not (os.path.exists("/usr/bin/redis-server") or shutil.which("redis-server")):
    pytest.skip("redis-server is missing: `make redis` (part of `make test`) installs it", allow_module_level=True)

#: path-stall: a stalled path holds private entries in flight while the client gives the connection up;
#: fanout_client's acknowledged subscription gets them again (docs/reliability.md, "Findings");
#: redis-stall: Redis stopped (SIGSTOP) 3 s, publishes wait. With 110 s the faults up to redis-wipe run.
FAULTS = ["node-kill", "redis-restart", "slow-reader", "path-stall", "redis-stall", "storm", "redis-wipe", "burst",
          "path-cut", "takeover"]


def test_chaos_short_form_no_violation_every_client_served_again_bounded_growth(tmp_path: Path) -> None:
    result = chaos.run(duration=110.0, faults=FAULTS, out=tmp_path, seed=1, sample_s=3.0, warmup=15.0)
    print(chaos.report(result))
    assert result["check"]["violations"] == []
    assert {f["name"] for f in result["faults"]} >= {"node-kill", "redis-restart", "slow-reader", "storm", "redis-stall"}
    # the private queues over SSE (acks POSTed) and long-poll got their messages (checked by the invariant)
    for client in ("sse-priv-u2", "lp-priv-u3"):
        assert result["check"]["streams"][client][chaos.PRIVATE]["messages"] > 0, client
    for name, figures in result["recovery"].items():
        assert figures["unserved"] == 0, (name, figures)
        assert figures["recovery_s"] is not None and figures["recovery_s"]["max"] < 15.0, (name, figures)
    # every client got messages on every shared topic
    for client, topics in result["check"]["streams"].items():
        for topic in chaos.RING + [chaos.SNAP]:
            assert topics[topic]["messages"] > 0, (client, topic)
    assert result["logs"]["bad_lines"] == 0, result["logs"]["first"]
    assert (tmp_path / "chaos.json").stat().st_size > 0
    for process, g in result["growth"].items():
        if process.startswith("node") and g["span_s"] >= 40:
            assert g["rss"]["growth_pct"] <= 10.0, (process, g)
            assert g["fds"]["end"] <= g["fds"]["start"] * 1.1 + 15, (process, g)
            if "tasks" in g:  # asyncio tasks: connections and their timers come and go, they do not pile up
                assert g["tasks"]["end"] <= g["tasks"]["start"] * 1.1 + 15, (process, g)
