"""Redis Cluster (`[broker] cluster_addresses`, gateway/broker/cluster_link.py): two gateway nodes on a real
3-primary, 3-replica cluster on loopback (`redis-cli --cluster create`, cluster-node-timeout 2000). Topics spread
over the shards, their channels are shard channels (SSUBSCRIBE on the slot's primary, SPUBLISH from the scripts)
and none travels by classic pub/sub; a shard's primary killed (-9) is a Redis back from an older state for
its topics (an exact `epoch` notice where the promoted replica lacked writes) while the other shards' topics
go on without a notice; a slot moved to another primary under publishing loses nothing.

One cluster and one pair of nodes for the module (a cluster's start is the module's cost): each test has topics
of its own, and the failover tests pick a shard that still has its replica."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.testing import TEST_JWT_SECRET
from loadtest.clusterproc import ClusterTopology, key_slot
from tests.cluster.cluster_helpers import TOKEN, Node, subscribe, topology_nodes
from tests.cluster.test_private_cluster import PrivateNode, ws_as
from tests.cluster.test_user_control_cluster import close_of


def topics(prefix: str) -> list[str]:
    """Topic names on distinct slots, enough of them to land on every shard; one prefix per test."""
    return [f"{prefix}{i}" for i in range(12)]


def seqs(entries: list[dict]) -> list[int]:
    return [e["seq"] for e in entries if e["type"] == "msg"]


def slot(topic: str) -> int:
    return key_slot(f"fanout:{{{topic}}}:c")


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    topology = ClusterTopology(tmp_path_factory.mktemp("redis"))
    topology.start()
    yield topology
    topology.stop()


@pytest.fixture(scope="module")
def cluster_nodes(tmp_path_factory, topology) -> Iterator[tuple[Node, Node]]:
    """Two gateway nodes on the cluster, with private queues (`private.*`) besides the ring topics."""
    with topology_nodes(tmp_path_factory.mktemp("gw"), topology.broker_section(), TEST_JWT_SECRET) as start:
        yield start("a", PrivateNode), start("b", PrivateNode)


def with_replica(topology: ClusterTopology, candidates: list[str], away_from: object = None) -> str:
    """The first topic whose shard's primary still has a replica in sync (an earlier test may have
    killed that shard's old primary) and is not `away_from`."""
    for topic in candidates:
        primary = topology.primary_of(slot(topic))
        if primary is not away_from and "connected_slaves:1" in primary.reply("INFO", "replication"):
            return topic
    raise AssertionError("no shard with a replica left")


def by_topic(ws, until, timeout: float = 10.0) -> dict[str, list[dict]]:
    """`msg` and `loss` entries (and `subscribed` after the first) by topic, until `until(entries by topic)`."""
    got: dict[str, list[dict]] = {}
    for entry in getattr(ws, "pending", []):
        got.setdefault(entry.get("topic"), []).append(entry)
    ws.pending = []
    deadline = time.monotonic() + timeout
    while not until(got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; got { ({t: e[-3:] for t, e in got.items()}) }"
        for entry in orjson.loads(ws.recv(timeout=remaining)):
            if entry["type"] in ("msg", "loss", "subscribed"):
                got.setdefault(entry["topic"], []).append(entry)
    return got


def publish_until_accepted(node: Node, topic: str, data: str, deadline: float) -> list[int]:
    """Publish until accepted (meanwhile `broker_unavailable` only), the seqs it got."""
    while True:
        reply = node.publish(topic, data)
        if reply.status_code == 200:
            return reply.json()["seqs"]
        assert reply.json()["error"]["code"] == "broker_unavailable", reply.text
        assert time.monotonic() < deadline, "publishes were not accepted again"
        time.sleep(0.1)


def test_topics_spread_over_the_shards_by_sharded_pub_sub_in_seq_order_on_both_nodes(topology, cluster_nodes):
    a, b = cluster_nodes
    names = topics("s")
    with a.ws() as on_a, b.ws() as on_b:
        for topic in names:
            subscribe(on_a, topic)
            subscribe(on_b, topic)
        for i in range(3):
            for topic in names:
                assert a.publish(topic, f"{topic}-{i}").json()["seqs"] == [i]
        for ws in (on_a, on_b):
            got = by_topic(ws, lambda g: all(len(seqs(g.get(t, []))) >= 3 for t in names))
            for topic in names:
                assert [(e["seq"], e["data"]) for e in got[topic]] == [(i, f"{topic}-{i}") for i in range(3)]
    shards_used = set()
    for node in topology.live():
        assert "fanout:{" not in node.reply("PUBSUB", "CHANNELS")  # no topic channel by classic pub/sub
        shard_channels = node.reply("PUBSUB", "SHARDCHANNELS")
        if "fanout:{s" in shard_channels:
            shards_used.add(node.port)
    assert len(shards_used) > 1
    # every topic's channel is subscribed on the primary that holds its slot
    for topic in names:
        assert f"fanout:{{{topic}}}:c" in topology.primary_of(slot(topic)).reply("PUBSUB", "SHARDCHANNELS")
    # the cluster-wide listing, which the nodes write once a second (topic_directory.py)
    deadline = time.monotonic() + 5
    while not {t["name"] for t in b.api("/topics")["topics"]} >= set(names):
        assert time.monotonic() < deadline, b.api("/topics")
        time.sleep(0.2)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def tiles(entries: list[dict]) -> list[int]:
    """The seqs a subscriber got, checking that its line tiles: each message is the next seq, or follows an
    exact loss notice (`loss [cursor, null)` `epoch` then `subscribed` of the new epoch at that seq)."""
    got, expect = [], None
    for entry in entries:
        if entry["type"] == "loss":
            assert entry["from"] == expect and entry["to"] is None and entry["reason"] == "epoch", entry
        elif entry["type"] == "subscribed":
            expect = entry["seq"]
        else:
            assert expect is None or entry["seq"] == expect, (entry, expect)
            got.append(entry["seq"])
            expect = entry["seq"] + 1
    return got


def test_a_shard_primary_killed_only_its_topics_may_start_a_new_epoch_and_publishing_resumes(topology, cluster_nodes):
    a, b = cluster_nodes
    names = topics("k")
    names.insert(0, names.pop(names.index(with_replica(topology, names))))  # the victim's topic first
    victim_slot = slot(names[0])
    with a.ws() as on_a, b.ws() as on_b:
        for topic in names:
            subscribe(on_a, topic)
            subscribe(on_b, topic)
        for topic in names:
            for i in range(2):
                assert b.publish(topic, f"{topic}-{i}").json()["seqs"] == [i]
        for ws in (on_a, on_b):
            by_topic(ws, lambda g: all(len(seqs(g.get(t, []))) >= 2 for t in names))
        dead = topology.kill_primary(victim_slot)
        on_dead_shard = {t for t in names if topology.primary_of(slot(t)) is dead}
        assert names[0] in on_dead_shard and len(on_dead_shard) < len(names)
        killed = time.monotonic()
        after = {topic: publish_until_accepted(a, topic, "after", killed + 20)[0] for topic in names}
        resumed = time.monotonic() - killed
        assert topology.wait_promoted(victim_slot, dead) is not dead
        for ws in (on_a, on_b):
            got = by_topic(ws, lambda g: all(after[t] in seqs(g.get(t, [])) for t in names), timeout=15)
            for topic in names:
                line = tiles(got[topic])
                assert line[-1] == after[topic]
                if topic not in on_dead_shard:  # the other shards' topics went on untouched
                    assert [e["type"] for e in got[topic]] == ["msg"] and after[topic] == 2, got[topic]
        for topic in names:
            assert a.api(f"/topics/{topic}")["epoch"] == b.api(f"/topics/{topic}")["epoch"]
    assert resumed < 10, resumed


def test_a_shard_failover_to_a_replica_that_lacked_writes_is_announced_exactly(topology, cluster_nodes):
    a, b = cluster_nodes
    # a topic away from the cluster-wide keys' shard: the cut-off primary takes no new connection (the nodes'
    # stats writes there would open one, which its password refuses)
    wide = topology.primary_of(key_slot("{cluster wide}"))
    fo = with_replica(topology, topics("f"), away_from=wide)
    with a.ws() as on_a, b.ws() as on_b:
        old = subscribe(on_a, fo)["epoch"]
        subscribe(on_b, fo)
        for i in range(3):
            assert a.publish(fo, f"m{i}").json()["seqs"] == [i]
        primary = topology.lag_replica(slot(fo))  # the replica holds seqs 0-2 only
        for i in range(3, 6):
            assert b.publish(fo, f"m{i}").json()["seqs"] == [i]  # accepted by the primary alone
        for ws in (on_a, on_b):
            assert seqs(by_topic(ws, lambda g: 5 in seqs(g.get(fo, [])))[fo]) == [0, 1, 2, 3, 4, 5]
        topology.kill(primary)
        # Seqs 3-5 are lost with the old primary, and were delivered: the topic starts a new epoch at 6 on
        # both nodes, no seq is given twice, and every subscriber is told exactly.
        assert publish_until_accepted(a, fo, "after", time.monotonic() + 20) == [6]
        for ws in (on_a, on_b):
            got = by_topic(ws, lambda g: 6 in seqs(g.get(fo, [])), timeout=15)[fo]
            assert got[0] == {"type": "loss", "topic": fo, "from": 6, "to": None, "reason": "epoch"}
            assert got[1]["type"] == "subscribed" and got[1]["epoch"] != old and got[1]["seq"] == 6
            assert [(e["seq"], e["data"]) for e in got[2:]] == [(6, "after")]
        assert a.api(f"/topics/{fo}")["epoch"] == b.api(f"/topics/{fo}")["epoch"] == got[1]["epoch"]


def test_a_slot_moved_to_another_primary_under_publishing_loses_nothing(topology, cluster_nodes):
    a, b = cluster_nodes
    topic = "moved0"
    accepted: list[int] = []
    stop = threading.Event()

    def publisher() -> None:
        while not stop.is_set():
            reply = a.publish(topic, f"m{len(accepted)}")
            if reply.status_code == 200:
                accepted.extend(reply.json()["seqs"])
            else:  # a moment without the slot: refused, not lost
                assert reply.json()["error"]["code"] == "broker_unavailable", reply.text
            time.sleep(0.01)

    with a.ws() as on_a, b.ws() as on_b:
        subscribe(on_a, topic)
        subscribe(on_b, topic)
        thread = threading.Thread(target=publisher)
        thread.start()
        try:
            wait_until(lambda: len(accepted) >= 5)
            source = topology.primary_of(slot(topic))
            target = next(p for p in topology.primaries() if p is not source)
            assert topology.move_slot(slot(topic), target) >= 2  # the topic's meta and stream moved
            assert topology.primary_of(slot(topic)) is target
            moved = len(accepted)
            wait_until(lambda: len(accepted) >= moved + 5)
        finally:
            stop.set()
            thread.join()
        assert accepted == list(range(len(accepted)))
        for ws in (on_a, on_b):
            got = by_topic(ws, lambda g: accepted[-1] in seqs(g.get(topic, [])))
            assert tiles(got[topic]) == accepted
    assert f"fanout:{{{topic}}}:c" in target.reply("PUBSUB", "SHARDCHANNELS")
    assert f"fanout:{{{topic}}}:c" not in source.reply("PUBSUB", "SHARDCHANNELS")


def test_private_queues_control_commands_and_the_node_registry_work_across_shards(topology, cluster_nodes):
    a, b = cluster_nodes
    with ws_as(a, "pat") as pat:
        subscribe(pat, "private.q")
        for i in range(3):  # published on b, queued in the queue's slot, pulled by a (its shard channel)
            assert b.publish("private.q", {"i": i}, client="pat").json()["seqs"] == [i]
        got = by_topic(pat, lambda g: len(seqs(g.get("private.q", []))) >= 3)
        assert [(e["seq"], e["data"]) for e in got["private.q"]] == [(i, {"i": i}) for i in range(3)]
        # the control channel is a shard channel too: SPUBLISH counts the nodes that answer
        reply = httpx.delete(f"{b.http_url}/api/users/pat", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert reply.json() == {"user": "pat", "disconnected": 1, "nodes": 2}, reply.text
        assert close_of(pat)[0] == 4005
    deadline = time.monotonic() + 5  # the node registry (one slot): every node's stats
    while len(a.api("/stats")["cluster"]["nodes"]) != 2:
        assert time.monotonic() < deadline, a.api("/stats")["cluster"]
        time.sleep(0.2)
    for node in topology.live():
        assert node.reply("PUBSUB", "CHANNELS").startswith("*0")  # nothing by classic pub/sub, control included
