"""Several gateway processes on one real Redis (docs/cluster.md): shared seqs and epochs, recovery from the
stream after kill -9 and restarts, exact loss notices when Redis or a node's channel goes away, workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket

import pytest

from gateway.config import ConfigError, load_config
from loadtest.redisproc import free_port
from tests.cluster.cluster_helpers import collect, messages, send, subscribe
from tests.gateway.gw_helpers import wait_for


@pytest.fixture(scope="module")
def pair(module_nodes):
    """Nodes A and B on the module's Redis, for the tests that need no overrides (each on topics of its own);
    the tests that stop or restart Redis, or need a Redis of their own, use `nodes`."""
    return module_nodes.start("a"), module_nodes.start("b")


def seqs(entries: list[dict]) -> list[int]:
    return [e["seq"] for e in entries if e["type"] == "msg"]


def subscribed_with_three(ws, topic: str, via) -> dict:
    """Subscribe `ws` to `topic`, publish 0, 1, 2 to it through the node `via` and see them arrive with seqs
    0, 1, 2; the `subscribed` entry."""
    subscribed = subscribe(ws, topic)
    for i in range(3):
        via.publish(topic, i)
    assert seqs(messages(ws, topic, lambda g: len(g) >= 3)) == [0, 1, 2]
    return subscribed


def test_a_subscriber_on_one_node_gets_what_another_publishes_same_seqs_same_epoch(pair):
    a, b = pair
    with a.ws() as on_a, b.ws() as on_b:
        sub_a, sub_b = subscribe(on_a, "news"), subscribe(on_b, "news")
        assert sub_a["epoch"] == sub_b["epoch"] and sub_a["seq"] == sub_b["seq"] == 0
        for i in range(10):  # alternating publishers: Redis orders them
            assert (b if i % 2 else a).publish("news", {"i": i}).json()["seqs"] == [i]
        got_a = messages(on_a, "news", lambda g: len(g) >= 10)
        got_b = messages(on_b, "news", lambda g: len(g) >= 10)
        assert seqs(got_a) == seqs(got_b) == list(range(10))
        assert [e["data"]["i"] for e in got_a] == list(range(10))
        # a client publish on B is answered with Redis's seq and reaches A
        send(on_b, op="publish", topic="news", data="hi", id="p")
        reply = next(e for e in collect(on_b, lambda g: any(e.get("id") == "p" for e in g)) if e.get("id") == "p")
        assert reply == {"type": "reply", "id": "p", "result": {"seq": 10}}
        assert seqs(messages(on_a, "news", lambda g: len(g) >= 1)) == [10]
    listed = {t["name"]: t for t in a.api("/topics")["topics"]}
    assert listed["news"]["epoch"] == sub_a["epoch"] and listed["news"]["end"] == 11


def test_kill_9_the_client_recovers_on_another_node_from_the_stream_or_gets_the_exact_loss(module_nodes, pair):
    victim = module_nodes.start("victim")
    c, b = pair  # c serves no "k" when asked: it reads the stream too
    with victim.ws() as ws:
        epoch = subscribed_with_three(ws, "k", via=b)["epoch"]
        victim.kill9()
    for i in range(3, 8):
        b.publish("k", i)
    with b.ws() as ws:  # the node never served "k": it reads the stream
        assert subscribe(ws, "k", since=(epoch, 3))["seq"] == 3
        assert seqs(messages(ws, "k", lambda g: len(g) >= 5)) == [3, 4, 5, 6, 7]
    for i in range(8, 38):  # 30 more: the ring (and the stream) hold the last 16
        b.publish("k", i)
    with c.ws() as ws:
        assert subscribe(ws, "k", since=(epoch, 8))["seq"] == 22
        got = messages(ws, "k", lambda g: len(g) >= 17)
        assert got[0] == {"type": "loss", "topic": "k", "from": 8, "to": 22, "reason": "gone"}
        assert seqs(got[1:]) == list(range(22, 38))


def test_a_restarted_gateway_keeps_the_epoch_and_recovery_works_across_it(module_nodes):
    a = module_nodes.start("restarted")
    for i in range(3):
        a.publish("r", i)
    epoch = a.api("/topics/r")["epoch"]
    a.stop()
    a.start()
    assert a.api("/topics/r")["epoch"] == epoch
    with a.ws() as ws:
        sub = subscribe(ws, "r", since=(epoch, 1))
        assert (sub["epoch"], sub["seq"]) == (epoch, 1)
        assert seqs(messages(ws, "r", lambda g: len(g) >= 2)) == [1, 2]
        a.publish("r", 3)
        assert seqs(messages(ws, "r", lambda g: len(g) >= 1)) == [3]


def test_redis_lost_publishes_are_refused_and_subscribers_learn_the_new_epoch_when_it_returns(nodes, redis_server):
    a = nodes.start("a")
    with a.ws() as ws:
        old = subscribed_with_three(ws, "z", via=a)["epoch"]
        redis_server.stop()
        refused = wait_for(lambda: (r := a.publish("z", "lost?")).status_code == 503 and r, what="a 503")
        assert refused.json()["error"]["code"] == "broker_unavailable"
        assert refused.headers["retry-after"] == "1"
        send(ws, op="publish", topic="z", data="x", id="p")
        error = next(e for e in collect(ws, lambda g: any(e.get("id") == "p" for e in g)) if e.get("id") == "p")
        assert error["type"] == "error" and error["code"] == "broker_unavailable"
        redis_server.start()  # empty: no persistence, so a new epoch
        wait_for(lambda: a.publish("z", "back").status_code == 200, what="publishes after Redis returned")
        got = messages(ws, "z", lambda g: any(e["type"] == "msg" for e in g))
        assert got[0] == {"type": "loss", "topic": "z", "from": 3, "to": None, "reason": "epoch"}
        assert got[1]["type"] == "subscribed" and got[1]["epoch"] != old and got[1]["seq"] == 0
        assert got[2]["seq"] == 0 and got[2]["data"] == "back"


def test_messages_missed_on_a_dropped_channel_are_filled_from_the_stream_or_announced_exactly(pair, module_redis):
    a, b = pair
    with a.ws() as ws:
        subscribed_with_three(ws, "g", via=b)
        # A is frozen, its channel connection is cut, and 40 messages go by (the stream keeps 16).
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            assert module_redis.command("CLIENT", "KILL", "TYPE", "pubsub").startswith(":")
            for i in range(3, 43):  # B's channel connection (the control channel's) is cut too: B refuses
                # publishes (503, not landed) until it has reconnected, half a second later
                wait_for(lambda i=i: b.publish("g", i).status_code == 200, what="B to take publishes again")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        got = messages(ws, "g", lambda g: 42 in seqs(g), timeout=15)
        assert got[0] == {"type": "loss", "topic": "g", "from": 3, "to": 27, "reason": "skipped"}
        assert seqs(got[1:]) == list(range(27, 43))


def test_two_workers_serve_one_port_and_every_subscriber_gets_every_message(nodes):
    node = nodes.start("w", server={"workers": 2})
    assert len(node.info["workers"]) == 2
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(node.ws()) for _ in range(6)]
        for ws in clients:
            subscribe(ws, "w")
        with socket.create_connection(("127.0.0.1", node.ingest_port), timeout=5) as ingest:
            for i in range(10):  # each request a new connection: the kernel spreads them over the workers
                assert node.publish("w", i).json()["seqs"] == [i]
            ingest.sendall(
                b"".join(json.dumps({"topic": "w", "data": i}).encode() + b"\n" for i in range(10, 20)) + b'{"sync": 1}\n'
            )
            assert json.loads(ingest.makefile().readline()) == {"type": "synced", "id": 1, "accepted": 10, "refused": 0}
        for ws in clients:
            assert seqs(messages(ws, "w", lambda g: len(g) >= 20)) == list(range(20))
        # both workers report to Redis; the stats count every client, whichever worker holds it
        wait_for(
            lambda: (c := node.api("/stats")["cluster"]) and len(c["nodes"]) == 2 and c["clients"] == 6,
            what="2 workers and 6 clients in the cluster stats",
        )
    assert node.stop() == 0, node.log()[-2000:]  # SIGTERM: a clean stop of every worker is a success
    assert "ended with status" not in node.log()


def test_workers_need_a_broker():
    with pytest.raises(ConfigError, match="needs a broker"):
        load_config(overrides={"server": {"workers": 2}}, environ={})


def test_redis_down_at_start_is_a_clear_error_after_the_connect_timeout(nodes):
    nodes.redis.port = free_port()  # nothing listens there
    node = nodes.start("down", wait=False, broker={"connect_timeout_s": 1.0})
    assert node.proc.wait(20) == 2
    assert "unreachable after 1 s" in node.log()
    assert "retrying" in node.log()
