"""The chaos run on Redis behind Sentinel (`fanout-loadtest chaos --redis sentinel`, docs/cluster.md): two
gateway nodes on a primary, a replica and three sentinels (down-after 1 s); the primary killed (-9) twice under
load, the sentinels promoting the replica each time (the killed process comes back as the new replica), a
node killed between. The invariant holds, publishing resumes and every client is served again within 15 s."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loadtest import chaos
from tests.loadtest.chaos_checks import assert_served_again

if not (os.path.exists("/usr/bin/redis-server") or shutil.which("redis-server")):
    pytest.skip("redis-server is missing: `make redis` (part of `make test`) installs it", allow_module_level=True)

FAULTS = ["primary-kill", "node-kill", "primary-kill"]


def test_chaos_on_sentinel_primary_kills_no_violation_every_client_served_again(tmp_path: Path) -> None:
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
        redis="sentinel",
    )
    print(chaos.report(result))
    assert result["check"]["violations"] == []
    assert [f["name"] for f in result["faults"]] == FAULTS
    kills = [f for f in result["faults"] if f["name"] == "primary-kill"]
    assert all(f["detail"]["promoted"] for f in kills), kills
    # publishes accepted again within 10 s of the kill; every client served within 15 s of it (`recovery`
    # counts from the kill for this fault)
    assert all(f["detail"]["accepted_s"] is not None and f["detail"]["accepted_s"] < 10 for f in kills), kills
    assert_served_again(result)
