"""Redis behind Sentinel (`[broker] sentinel_addresses`, gateway/broker/link.py): two gateway nodes follow a
failover to a replica that lacked accepted writes, announce the loss per topic exactly as for a restored
snapshot (`loss [cursor, null)` `epoch`, then `subscribed` of the new epoch), give no seq twice, and take
publishes again. A real topology on loopback: a primary, a replica, three sentinels (down-after 1 s).

A topology's start and its failover are the cost: one failover serves the three cases at once (a topic both
nodes serve, one nobody serves, a private queue), each on a topic of its own, each checked on its own."""

from __future__ import annotations

import time

import pytest

from gateway.testing import TEST_JWT_SECRET
from loadtest.sentinelproc import SentinelTopology
from tests.cluster.cluster_helpers import messages, subscribe, topology_nodes
from tests.cluster.test_private_cluster import PrivateNode, msgs, ws_as


def seqs(entries: list[dict]) -> list[int]:
    return [e["seq"] for e in entries if e["type"] == "msg"]


@pytest.fixture
def topology(tmp_path):
    topology = SentinelTopology(tmp_path / "redis")
    topology.start()
    yield topology
    topology.stop()


@pytest.fixture
def sentinel_nodes(tmp_path, topology):
    with topology_nodes(tmp_path, topology.broker_section(), TEST_JWT_SECRET) as start:
        yield start


def publish_until_accepted(node, topic: str, data: object, deadline: float, **extra) -> list[int]:
    """Publish until accepted (meanwhile `broker_unavailable` only: refused, none lost); the seqs it got."""
    while (reply := node.publish(topic, data, **extra)).status_code != 200:
        assert reply.json()["error"]["code"] == "broker_unavailable", reply.text
        assert time.monotonic() < deadline, f"publishes to {topic} were not accepted again"
        time.sleep(0.1)
    return reply.json()["seqs"]


def test_one_failover_to_a_replica_that_lacked_writes_is_announced_and_gives_no_seq_twice(topology, sentinel_nodes):
    """`fo`: served by both nodes, seqs 3-5 delivered then lost: a new epoch at 6, told exactly to both.
    `quiet`: served by no node, so only the publisher's node knows Redis accepted 3-5: 6 next, not 3 again.
    `private.inbox` (alice, on a): her node pulled 3-5 from the old primary: 6 next, not 3."""
    a, b = sentinel_nodes("a", PrivateNode), sentinel_nodes("b", PrivateNode)
    with a.ws() as on_a, b.ws() as on_b, ws_as(a, "alice") as alice:
        old = subscribe(on_a, "fo")["epoch"]
        subscribe(on_b, "fo")
        subscribe(alice, "private.inbox")
        for i in range(3):
            assert a.publish("fo", f"m{i}").json()["seqs"] == [i]
            assert a.publish("quiet", f"m{i}").json()["seqs"] == [i]
            assert a.publish("private.inbox", i, client="alice").json()["seqs"] == [i]
        quiet_old = a.api("/topics/quiet")["epoch"]
        assert msgs(messages(alice, "private.inbox", lambda g: len(msgs(g)) >= 3)) == [(0, 0), (1, 1), (2, 2)]
        topology.lag_replica()  # the replica holds seqs 0-2 only (of all three)
        for i in range(3, 6):
            assert b.publish("fo", f"m{i}").json()["seqs"] == [i]  # accepted by the primary alone
            assert a.publish("quiet", f"m{i}").json()["seqs"] == [i]
            assert a.publish("private.inbox", i, client="alice").json()["seqs"] == [i]
        for ws in (on_a, on_b):
            assert seqs(messages(ws, "fo", lambda g: 5 in seqs(g))) == [0, 1, 2, 3, 4, 5]
        assert msgs(messages(alice, "private.inbox", lambda g: len(msgs(g)) >= 3)) == [(3, 3), (4, 4), (5, 5)]

        killed = time.monotonic()
        topology.kill_primary()
        accepted = publish_until_accepted(a, "fo", "after", killed + 20)
        resumed = time.monotonic() - killed
        assert topology.promoted(topology.replica.port)
        # fo: seqs 3-5 are lost with the old primary, and were delivered: the topic starts a new epoch at 6 on
        # every node, so no seq is given twice, and every subscriber is told exactly.
        assert accepted == [6]
        for ws in (on_a, on_b):
            got = messages(ws, "fo", lambda g: 6 in seqs(g), timeout=15)
            assert got[0] == {"type": "loss", "topic": "fo", "from": 6, "to": None, "reason": "epoch"}
            assert got[1]["type"] == "subscribed" and got[1]["epoch"] != old and got[1]["seq"] == 6
            assert [(e["seq"], e["data"]) for e in got[2:]] == [(6, "after")]
        assert a.api("/topics/fo")["epoch"] == b.api("/topics/fo")["epoch"] == got[1]["epoch"]

        # private.inbox: not 3, alice had 3-5 already
        assert publish_until_accepted(a, "private.inbox", "after", killed + 20, client="alice") == [6]
        assert msgs(messages(alice, "private.inbox", lambda g: len(msgs(g)) >= 1)) == [(6, "after")]

    # quiet: the promoted replica lacks 3-5; it must not give seq 3 to another message
    assert publish_until_accepted(a, "quiet", "after", killed + 20) == [6]
    info = a.api("/topics/quiet")
    assert info["epoch"] != quiet_old and info["end"] == 7
    with a.ws() as ws:  # a client that had read up to seq 3 of the old epoch is told exactly
        entry = subscribe(ws, "quiet", since=(quiet_old, 3))
        assert (entry["epoch"], entry["seq"]) == (info["epoch"], 6)
        assert messages(ws, "quiet", lambda g: 6 in seqs(g)) == [
            {"type": "loss", "topic": "quiet", "from": 3, "to": None, "reason": "epoch"},
            {"type": "msg", "topic": "quiet", "seq": 6, "data": "after"},
        ]
    assert resumed < 15, resumed
