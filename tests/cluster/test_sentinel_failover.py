"""Redis behind Sentinel (`[broker] sentinel_addresses`, gateway/broker/link.py): two gateway nodes follow a
failover to a replica that lacked accepted writes, announce the loss per topic exactly as for a restored
snapshot (`loss [cursor, null)` `epoch`, then `subscribed` of the new epoch), give no seq twice, and take
publishes again. A real topology on loopback: a primary, a replica, three sentinels (down-after 1 s)."""

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


def test_a_failover_to_a_replica_that_lacked_writes_is_announced_and_publishing_resumes(topology, sentinel_nodes):
    a, b = sentinel_nodes("a"), sentinel_nodes("b")
    with a.ws() as on_a, b.ws() as on_b:
        old = subscribe(on_a, "fo")["epoch"]
        subscribe(on_b, "fo")
        for i in range(3):
            assert a.publish("fo", f"m{i}").json()["seqs"] == [i]
        topology.lag_replica()  # the replica holds seqs 0-2 only
        for i in range(3, 6):
            assert b.publish("fo", f"m{i}").json()["seqs"] == [i]  # accepted by the primary alone
        for ws in (on_a, on_b):
            assert seqs(messages(ws, "fo", lambda g: 5 in seqs(g))) == [0, 1, 2, 3, 4, 5]

        killed = time.monotonic()
        topology.kill_primary()
        accepted = None
        deadline = killed + 20
        while accepted is None:  # meanwhile publishes are refused (broker_unavailable), none is lost
            assert time.monotonic() < deadline, "publishes were not accepted again"
            reply = a.publish("fo", "after")
            if reply.status_code == 200:
                accepted = reply.json()["seqs"]
            else:
                assert reply.json()["error"]["code"] == "broker_unavailable", reply.text
                time.sleep(0.1)
        resumed = time.monotonic() - killed
        assert topology.promoted(topology.replica.port)
        # Seqs 3-5 are lost with the old primary, and were delivered: the topic starts a new epoch at 6 on
        # every node, so no seq is given twice, and every subscriber is told exactly.
        assert accepted == [6]
        for ws in (on_a, on_b):
            got = messages(ws, "fo", lambda g: 6 in seqs(g), timeout=15)
            assert got[0] == {"type": "loss", "topic": "fo", "from": 6, "to": None, "reason": "epoch"}
            assert got[1]["type"] == "subscribed" and got[1]["epoch"] != old and got[1]["seq"] == 6
            assert [(e["seq"], e["data"]) for e in got[2:]] == [(6, "after")]
        assert a.api("/topics/fo")["epoch"] == b.api("/topics/fo")["epoch"] == got[1]["epoch"]
    assert resumed < 15, resumed


def test_seqs_accepted_for_a_topic_nobody_served_are_not_given_again_after_a_failover(topology, sentinel_nodes):
    # No node serves the topic, so no node delivered seqs 3-5: only the publisher's node knows Redis
    # accepted them. The promoted replica lacks them; it must not give seq 3 to another message.
    a = sentinel_nodes("a")
    for i in range(3):
        assert a.publish("quiet", f"m{i}").json()["seqs"] == [i]
    old = a.api("/topics/quiet")["epoch"]
    topology.lag_replica()
    for i in range(3, 6):
        assert a.publish("quiet", f"m{i}").json()["seqs"] == [i]
    topology.kill_primary()
    deadline = time.monotonic() + 20
    while (reply := a.publish("quiet", "after")).status_code != 200:
        assert reply.json()["error"]["code"] == "broker_unavailable" and time.monotonic() < deadline, reply.text
        time.sleep(0.1)
    assert reply.json()["seqs"] == [6]
    info = a.api("/topics/quiet")
    assert info["epoch"] != old and info["end"] == 7
    with a.ws() as ws:  # a client that had read up to seq 3 of the old epoch is told exactly
        entry = subscribe(ws, "quiet", since=(old, 3))
        assert (entry["epoch"], entry["seq"]) == (info["epoch"], 6)
        assert messages(ws, "quiet", lambda g: 6 in seqs(g)) == [
            {"type": "loss", "topic": "quiet", "from": 3, "to": None, "reason": "epoch"},
            {"type": "msg", "topic": "quiet", "seq": 6, "data": "after"},
        ]


def test_a_private_queue_the_promoted_replica_lacked_gives_no_seq_twice(topology, sentinel_nodes):
    # alice's node pulled seqs 3-5 of her queue from the old primary; the replica has the queue up to 3 only.
    a = sentinel_nodes("a", PrivateNode)
    with ws_as(a, "alice") as ws:
        subscribe(ws, "private.inbox")
        for i in range(3):
            assert a.publish("private.inbox", i, client="alice").json()["seqs"] == [i]
        assert msgs(messages(ws, "private.inbox", lambda g: len(msgs(g)) >= 3)) == [(0, 0), (1, 1), (2, 2)]
        topology.lag_replica()
        for i in range(3, 6):
            assert a.publish("private.inbox", i, client="alice").json()["seqs"] == [i]
        assert msgs(messages(ws, "private.inbox", lambda g: len(msgs(g)) >= 3)) == [(3, 3), (4, 4), (5, 5)]
        topology.kill_primary()
        deadline = time.monotonic() + 20
        while (reply := a.publish("private.inbox", "after", client="alice")).status_code != 200:
            assert reply.json()["error"]["code"] == "broker_unavailable" and time.monotonic() < deadline, reply.text
            time.sleep(0.1)
        assert reply.json()["seqs"] == [6]  # not 3: alice had 3-5 already
        assert msgs(messages(ws, "private.inbox", lambda g: len(msgs(g)) >= 1)) == [(6, "after")]
