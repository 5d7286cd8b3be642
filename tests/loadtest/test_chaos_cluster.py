"""The chaos run on Redis Cluster (`fanout-loadtest chaos --redis cluster`, docs/cluster.md §10): two gateway
nodes on three primaries and three replicas (cluster-node-timeout 2000); the primary of the first ring topic's
shard killed (-9) under load, the cluster promoting its replica (the killed process comes back as the new
replica), that topic's slot moved to another primary under load, then that primary killed too. The invariant
holds, publishing resumes within 10 s and every client is served again within 15 s."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loadtest import chaos
from tests.loadtest.chaos_checks import assert_served_again

if not (os.path.exists("/usr/bin/redis-server") or shutil.which("redis-server")):
    pytest.skip("redis-server is missing: `make redis` (part of `make test`) installs it", allow_module_level=True)

FAULTS = ["shard-kill", "slot-move", "shard-kill"]


def test_chaos_on_redis_cluster_shard_kills_and_a_slot_move_no_violation_every_client_served_again(tmp_path: Path) -> None:
    result = chaos.run(
        duration=120.0,
        faults=FAULTS,
        out=tmp_path,
        seed=1,
        sample_s=2.0,
        warmup=1.0,  # the clients subscribed before it (the run waits for that) and receive
        rounds=1,
        settle_s=15.0,
        pause=(0.2, 0.5),  # after every client was served again
        tail_s=2.0,
        redis="cluster",
    )
    print(chaos.report(result))
    assert result["check"]["violations"] == []
    assert [f["name"] for f in result["faults"]] == FAULTS
    kills = [f for f in result["faults"] if f["name"] == "shard-kill"]
    assert all(f["detail"]["promoted"] for f in kills), kills
    assert all(f["detail"]["accepted_s"] is not None and f["detail"]["accepted_s"] < 10 for f in kills), kills
    # every client got a message of the killed shard's topic published after the kill within 15 s of it
    assert all(f["detail"]["served_s"] is not None and f["detail"]["served_s"] < 15 for f in kills), kills
    moves = [f for f in result["faults"] if f["name"] == "slot-move"]
    assert moves[0]["detail"]["keys"] >= 2, moves  # the ring topic's meta and stream moved with the slot
    assert_served_again(result)
