"""Private queues in Redis across a Redis outage, and TCP ingest into a private queue through the broker
(docs/cluster.md §4, §8; docs/protocol.md, TCP ingest)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import orjson

from gateway.testing import make_token
from tests.cluster.cluster_helpers import messages, subscribe
from tests.cluster.test_private_cluster import TOPIC, msgs, start, ws_as
from tests.gateway.gw_helpers import wait_for


def refused_while_down(node, user: str) -> None:
    """Publishes to `user`'s queue get 503 `broker_unavailable` (`Retry-After: 1`) once the node saw Redis go."""
    refused = wait_for(lambda: (r := node.publish(TOPIC, "lost?", client=user)).status_code == 503 and r, what="a 503")
    assert refused.json()["error"]["code"] == "broker_unavailable"
    assert refused.headers["retry-after"] == "1"


def shutdown(redis_server, save: bool) -> None:
    """Stop redis-server: `SHUTDOWN SAVE` writes dump.rdb (read again by the next start in the same
    directory), `SHUTDOWN NOSAVE` leaves nothing, so it comes back empty."""
    redis_server.command("SHUTDOWN", "SAVE" if save else "NOSAVE")
    assert redis_server.proc.wait(5) is not None
    redis_server.proc = None


def test_redis_lost_and_back_with_its_data_every_queued_message_arrives_once_in_order(nodes, redis_server):
    a, b = start(nodes, "a"), start(nodes, "b")
    lp = httpx.Client(base_url=a.http_url, timeout=10)
    with ws_as(a, "alice") as ws:
        assert subscribe(ws, TOPIC)["seq"] == 0
        for i in range(3):  # read and written: committed, acknowledged in Redis
            assert b.publish(TOPIC, i, client="alice").json()["seqs"] == [i]
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 3)) == [(0, 0), (1, 1), (2, 2)]
        # a long-poll session of bob: entries handed out and not acknowledged across the outage
        session = lp.post("/lp", headers={"Authorization": f"Bearer {make_token('bob')}"}).json()["session"]
        assert lp.post(f"/lp/{session}", json={"op": "subscribe", "topic": TOPIC, "id": 1}).status_code == 202
        first = lp.get(f"/lp/{session}").json()
        for i in range(4):
            assert b.publish(TOPIC, i, client="bob").json()["seqs"] == [i]
        time.sleep(0.3)
        handed = msgs(lp.get(f"/lp/{session}", params={"ack": first["batch"]}).json()["entries"])
        assert handed == [(i, i) for i in range(len(handed))] and handed
        shutdown(redis_server, save=True)
        refused_while_down(a, "alice")
        refused_while_down(b, "bob")
        redis_server.start()  # the same data: the same queues, epochs and seqs
        wait_for(lambda: a.publish(TOPIC, 3, client="alice").status_code == 200, what="publishes after Redis returned")
        for i in range(4, 6):
            assert b.publish(TOPIC, i, client="alice").json()["seqs"] == [i]
        got = messages(ws, TOPIC, lambda g: len(msgs(g)) >= 3)
        assert [e["type"] for e in got] == ["msg"] * 3  # no loss, no new epoch: the connection went on
        assert msgs(got) == [(3, 3), (4, 4), (5, 5)]
    with ws_as(b, "alice") as ws:  # everything was committed and acknowledged: nothing comes again
        assert subscribe(ws, TOPIC)["seq"] == 6
    with ws_as(b, "bob") as ws:  # bob's handed-out entries were never acknowledged: they come again
        again = subscribe(ws, TOPIC)
        assert again["seq"] == 0
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 4)) == [(i, i) for i in range(4)]


def test_redis_back_empty_the_holder_makes_the_queue_again_and_its_subscriber_reads_on(nodes, redis_server):
    a, b = start(nodes, "a"), start(nodes, "b")
    with ws_as(a, "alice") as ws:
        subscribed = subscribe(ws, TOPIC)
        for i in range(3):
            assert b.publish(TOPIC, i, client="alice").json()["seqs"] == [i]
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 3)) == [(0, 0), (1, 1), (2, 2)]
        shutdown(redis_server, save=False)
        refused_while_down(b, "alice")
        redis_server.start()  # empty: the holder (a) makes alice's queue again, same epoch, at its local end
        accepted = wait_for(
            lambda: (r := b.publish(TOPIC, "back", client="alice")).status_code == 200 and r,
            what="publishes after Redis returned",
        )
        assert accepted.json()["seqs"] == [3]
        got = messages(ws, TOPIC, lambda g: len(msgs(g)) >= 1)
        assert got == [{"type": "msg", "topic": TOPIC, "seq": 3, "data": "back"}]  # nothing lost: no notice
        # written: committed, and acknowledged in the queue made again (the ack is sent after the write)
        wait_for(lambda: redis_server.command("LLEN", f"fanout:{{{TOPIC}}}:ql:alice") == ":0", what="the ack")
    with ws_as(b, "alice") as ws:  # the same queue, everything acknowledged
        again = subscribe(ws, TOPIC)
        assert (again["epoch"], again["seq"]) == (subscribed["epoch"], 4)


def test_redis_back_empty_after_it_took_messages_the_holder_never_pulled_closes_the_handle(nodes, redis_server):
    a, b = start(nodes, "a"), start(nodes, "b")
    with ws_as(a, "erin") as ws:
        subscribe(ws, TOPIC)
        assert b.publish(TOPIC, 0, client="erin").json()["seqs"] == [0]
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 1)) == [(0, 0)]
        os.kill(a.proc.pid, signal.SIGSTOP)  # a hears `n 3` only after Redis is gone: it cannot pull 1, 2
        try:
            for i in (1, 2):
                assert b.publish(TOPIC, i, client="erin").json()["seqs"] == [i]
            shutdown(redis_server, save=False)
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        redis_server.start()
        closed = messages_of(ws, lambda e: e["type"] == "closed")
        assert closed == {"type": "closed", "topic": TOPIC, "reason": "lost"}
        # the client subscribes again: a new queue, in a new epoch
        assert subscribe(ws, TOPIC)["seq"] == 0
        new = wait_for(
            lambda: (r := b.publish(TOPIC, "new", client="erin")).status_code == 200 and r, what="b back on Redis"
        )  # b reconnects on its own schedule
        assert new.json()["seqs"] == [0]
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 1)) == [(0, "new")]


def messages_of(ws, match, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "timed out"
        for entry in orjson.loads(ws.recv(timeout=remaining)):
            if match(entry):
                return entry


def test_ingest_on_one_node_reaches_a_private_subscriber_on_another_and_waits_while_the_queue_is_full(nodes):
    a = start(nodes, "a", max_count=4)
    b = start(nodes, "b", max_count=4)
    with ws_as(a, "carol") as ws:
        subscribe(ws, TOPIC)
    # carol left: her queue stays in Redis and fills up from b's ingest
    with socket.create_connection(("127.0.0.1", b.ingest_port), timeout=10) as ingest:
        ingest.sendall(
            b"".join(json.dumps({"topic": TOPIC, "client": "carol", "data": i}).encode() + b"\n" for i in range(6))
            + b'{"sync": 1}\n'
        )
        ingest.settimeout(1.0)
        try:
            early = ingest.recv(4096)
        except TimeoutError:
            early = b""
        assert early == b""  # 4 fit; the 5th waits for room: no `synced` yet
        ingest.settimeout(10)
        reader = ingest.makefile("rb")
        with ws_as(a, "carol") as ws:
            subscribe(ws, TOPIC)
            got = msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 6))
            assert got == [(i, i) for i in range(6)]
            assert orjson.loads(reader.readline()) == {"type": "synced", "id": 1, "accepted": 6, "refused": 0}
            # live: an ingest record reaches her at once, in order, after the others
            ingest.sendall(
                b"".join(json.dumps({"topic": TOPIC, "client": "carol", "data": f"x{i}"}).encode() + b"\n" for i in range(3))
                + b'{"sync": 2}\n'
            )
            assert orjson.loads(reader.readline()) == {"type": "synced", "id": 2, "accepted": 3, "refused": 0}
            assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 3)) == [(6 + i, f"x{i}") for i in range(3)]
