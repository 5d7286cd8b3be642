"""A Redis that went back in time (restored from an older snapshot: an RDB-only crash, a failover to a
replica that lagged) is detected and announced: the topic starts a new epoch with the `epoch` loss notice on
every node, and no seq is ever given to a second message (docs/cluster.md, failure table)."""

from __future__ import annotations

import re

import httpx

from tests.cluster.cluster_helpers import messages, subscribe
from tests.gateway.gw_helpers import wait_for


def seqs(entries: list[dict]) -> list[int]:
    return [e["seq"] for e in entries if e["type"] == "msg"]


def reconnect_failures(node) -> float:
    text = httpx.get(f"{node.http_url}/metrics").text
    return float(re.search(r"^fanout_broker_reconnect_failures_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def test_redis_restored_from_an_older_snapshot_starts_a_new_epoch_and_reuses_no_seq(nodes, redis_server):
    a, b = nodes.start("a"), nodes.start("b")
    with a.ws() as on_a, b.ws() as on_b:
        old = subscribe(on_a, "rw")["epoch"]
        subscribe(on_b, "rw")
        for i in range(3):
            a.publish("rw", f"m{i}")
        assert redis_server.command("SAVE") == "+OK"  # the snapshot Redis will come back from: next seq 3
        for i in range(3, 6):
            a.publish("rw", f"m{i}")
        for ws in (on_a, on_b):
            assert seqs(messages(ws, "rw", lambda g: 5 in seqs(g))) == [0, 1, 2, 3, 4, 5]

        redis_server.stop()  # kill -9: what was published after the SAVE is gone
        redis_server.start()  # loads the older snapshot: the same epoch, next seq 3
        failed_before = [reconnect_failures(node) for node in (a, b)]
        for ws in (on_a, on_b):  # every node announces it: the old epoch ends after seq 5, a new one begins at 6
            got = messages(ws, "rw", lambda g: any(e["type"] == "subscribed" for e in g), timeout=15)
            assert got[0] == {"type": "loss", "topic": "rw", "from": 6, "to": None, "reason": "epoch"}
            new = got[1]
            assert new["epoch"] != old and new["seq"] == 6

        wait_for(lambda: a.publish("rw", "after").status_code == 200, what="publishes after Redis returned")
        for ws in (on_a, on_b):
            got = messages(ws, "rw", lambda g: bool(seqs(g)))
            assert [(e["seq"], e["data"]) for e in got if e["type"] == "msg"] == [(6, "after")]
        assert a.api("/topics/rw")["epoch"] == new["epoch"]

    # Once Redis answered, each node reconnected at its next attempt: no attempt failed on a connection
    # left from before the restart (that cost a second round of 0.5 s), and Redis was lost only once.
    assert [reconnect_failures(node) for node in (a, b)] == failed_before
    for node in (a, b):
        assert len(re.findall(r"broker \S+ unavailable", node.log())) == 1, node.log()[-2000:]
    rewinds = [httpx.get(f"{node.http_url}/metrics").text for node in (a, b)]
    assert sum("fanout_broker_rewinds_total 1.0" in text for text in rewinds) >= 1  # the first to see it rewound


def test_a_publish_answered_with_a_seq_already_delivered_is_refused_and_the_topic_starts_a_new_epoch(nodes, redis_server):
    # Redis's counter goes back while the nodes stay connected (what a failover to a lagging replica does).
    a = nodes.start("a")
    with a.ws() as ws:
        old = subscribe(ws, "fo")["epoch"]
        for i in range(4):
            a.publish("fo", i)
        assert seqs(messages(ws, "fo", lambda g: 3 in seqs(g))) == [0, 1, 2, 3]
        assert redis_server.command("HSET", "fanout:{fo}:m", "n", "1") == ":0"  # back to the state after seq 0:
        assert redis_server.command("XTRIM", "fanout:{fo}:s", "MAXLEN", "0").startswith(":")  # its stream too,
        assert redis_server.command("XSETID", "fanout:{fo}:s", "0-1") == "+OK"  # down to seq 0's id
        refused = a.publish("fo", "would reuse seq 1")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "broker_unavailable"
        got = messages(ws, "fo", lambda g: any(e["type"] == "subscribed" for e in g), timeout=15)
        assert got[0] == {"type": "loss", "topic": "fo", "from": 4, "to": None, "reason": "epoch"}
        assert got[1]["epoch"] != old and got[1]["seq"] == 4
        retried = a.publish("fo", "retried")
        assert retried.json()["seqs"] == [4]
        assert [(e["seq"], e["data"]) for e in messages(ws, "fo", lambda g: bool(seqs(g))) if e["type"] == "msg"] == [
            (4, "retried")
        ]
