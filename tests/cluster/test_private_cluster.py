"""Private queues in Redis (docs/cluster.md §8): a queue outlives its subscriber's node (kill -9), entries
handed out but not committed come again with the same seqs, the queue is bounded in Redis, and the core
reports what each commit removed."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from core import Engine, EngineConfig, QueueFull, TopicConfig, TopicKind
from gateway.testing import TEST_JWT_SECRET, make_token
from tests.cluster.cluster_helpers import TOKEN, Node, messages, subscribe

TOPIC = "private.inbox"


class PrivateNode(Node):
    """A node whose `private.*` topics are private queues of at most `max_count` entries."""

    max_count = 8

    def config_text(self) -> str:
        rule = f'[[topics.rules]]\npattern = "private.*"\nkind = "private"\nmax_count = {self.max_count}\nbatch_depth = 4\n'
        text = super().config_text()
        first = text.index("[[topics.rules]]")  # before the catch-all ring rule: the first match wins
        return text[:first] + rule + text[first:]


def start(nodes, name: str, max_count: int = 8, **sections) -> Node:
    sections.setdefault("auth", {})["jwt_secret"] = TEST_JWT_SECRET
    node = PrivateNode(nodes.tmp_path / name, nodes.redis.url, sections)
    node.max_count = max_count
    nodes.nodes.append(node)
    return node.start()


@pytest.fixture(scope="module")
def pair(module_nodes) -> tuple[Node, Node]:
    """Nodes A and B with the default queue bound, for the tests that kill neither (each with users of its own)."""
    return start(module_nodes, "a"), start(module_nodes, "b")


def ws_as(node: Node, user: str):
    return connect(f"{node.ws_url}?token={make_token(user)}", open_timeout=5, max_size=None, compression=None)


def msgs(entries: list[dict]) -> list[tuple[int, object]]:
    return [(e["seq"], e["data"]) for e in entries if e["type"] == "msg"]


def test_a_queue_outlives_its_node_and_uncommitted_entries_come_again_with_their_seqs(module_nodes, pair):
    a, b = start(module_nodes, "killed"), pair[1]
    lp = httpx.Client(base_url=a.http_url, timeout=10)
    session = lp.post("/lp", headers={"Authorization": f"Bearer {make_token('alice')}"}).json()["session"]
    assert lp.post(f"/lp/{session}", json={"op": "subscribe", "topic": TOPIC, "id": 1}).status_code == 202
    first = lp.get(f"/lp/{session}").json()
    subscribed = next(e for e in first["entries"] if e["type"] == "subscribed")
    assert subscribed["seq"] == 0
    for i in range(3):  # published on the other node: Redis queues them for alice
        assert b.publish(TOPIC, {"i": i}, client="alice").json()["seqs"] == [i]
    time.sleep(0.3)  # all three in a's local view before the poll
    handed = msgs(lp.get(f"/lp/{session}", params={"ack": first["batch"]}).json()["entries"])
    assert handed and handed == [(i, {"i": i}) for i in range(len(handed))]  # handed out, never acknowledged
    a.kill9()
    for i in range(3, 6):  # alice's node is dead: her queue is in Redis
        assert b.publish(TOPIC, {"i": i}, client="alice").json()["seqs"] == [i]
    with ws_as(b, "alice") as ws:
        again = subscribe(ws, TOPIC)
        assert (again["epoch"], again["seq"]) == (subscribed["epoch"], 0)
        got = msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 6))
        assert got == [(i, {"i": i}) for i in range(6)]  # every one once, in order, same seqs
        # written to the WebSocket: committed, acknowledged in Redis; later ones follow live
        assert b.publish(TOPIC, "live", client="alice").json()["seqs"] == [6]
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 1)) == [(6, "live")]
    with ws_as(b, "alice") as ws:  # reconnect: nothing committed comes again
        assert subscribe(ws, TOPIC)["seq"] == 7
    # a queue nobody ever subscribed to does not take messages
    refused = b.publish(TOPIC, 1, client="bob")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_subscribed"


def test_the_queue_is_bounded_in_redis_and_a_held_back_publisher_goes_on_when_it_drains(nodes):
    a = start(nodes, "a", max_count=4, admin={"publish_timeout_s": 0.5})
    b = start(nodes, "b", max_count=4, admin={"publish_timeout_s": 10.0})
    with ws_as(a, "carol") as ws:
        subscribe(ws, TOPIC)  # creates carol's queue; it stays when she leaves
    for i in range(4):
        assert a.publish(TOPIC, i, client="carol").json()["seqs"] == [i]
    full = a.publish(TOPIC, "x", client="carol")
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    assert full.headers["Retry-After"] == "1"
    answer: dict[str, httpx.Response] = {}
    waiting = threading.Thread(target=lambda: answer.setdefault("r", b.publish(TOPIC, "late", client="carol")))
    waiting.start()  # held back on b until carol's queue drains (on a)
    time.sleep(0.5)
    assert "r" not in answer
    with ws_as(a, "carol") as ws:
        subscribe(ws, TOPIC)
        got = msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 4 + 1))
        waiting.join(10)
        assert answer["r"].json()["seqs"] == [4]
        assert got == [(i, i) for i in range(4)] + [(4, "late")]
    # an explicit unsubscribe removes the queue from Redis, as without a broker
    with ws_as(a, "carol") as ws:
        subscribe(ws, TOPIC)
        ws.send(orjson.dumps({"op": "unsubscribe", "topic": TOPIC, "id": "u"}).decode())
        deadline = time.monotonic() + 5
        while a.publish(TOPIC, 0, client="carol").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_takeover_on_another_node_closes_the_old_handle(pair):
    a, b = pair
    with ws_as(a, "dave") as old:
        subscribe(old, TOPIC)
        with ws_as(b, "dave") as new:
            subscribe(new, TOPIC)
            closed = [e for e in orjson.loads(old.recv(timeout=5)) if e["type"] == "closed"]
            assert closed == [{"type": "closed", "topic": TOPIC, "reason": "taken_over"}]
            assert a.publish(TOPIC, "x", client="dave").json()["seqs"] == [0]
            assert msgs(messages(new, TOPIC, lambda g: len(msgs(g)) >= 1)) == [(0, "x")]
    assert TOKEN  # the admin token of cluster_helpers


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["publish", "cycle", "commit", "rollback"]), max_size=40))
def test_a_commit_reports_the_first_seq_still_queued_and_it_only_grows(ops):
    engine = Engine(EngineConfig())
    engine.report_commits = True
    engine.create_topic("p", TopicConfig(kind=TopicKind.PRIVATE, max_count=5))
    engine.connect("c", owner="u")
    engine.subscribe("c", "p", queue_start=("e1", 10))
    published = 10
    handed: list[int] = []
    last = 10
    for op in ops:
        if op == "publish":
            try:
                engine.publish("p", published, owner="u")
                published += 1
            except QueueFull:
                pass
        elif op == "cycle":
            for batch in engine.run_cycle():
                handed += [orjson.loads(e)["seq"] for e in batch.entries if b'"msg"' in e]
        elif op == "commit":
            engine.write_done("c")
        else:
            engine.rollback("c")
            engine.mark_ready("c")
        for topic, owner, upto in engine.take_committed():
            assert (topic, owner) == ("p", "u")
            assert last <= upto <= published
            assert set(range(last, upto)) <= set(handed)  # only what was handed out leaves
            last = upto


def _subscribe_acked(ws, topic: str) -> dict:
    ws.send(orjson.dumps({"op": "subscribe", "topic": topic, "ack": True, "id": topic}).decode())
    got: list[dict] = []
    deadline = time.monotonic() + 10
    while not any(e.get("id") == topic for e in got):
        got += orjson.loads(ws.recv(timeout=deadline - time.monotonic()))
    ws.pending = [e for e in got if e.get("id") != topic]  # read by `messages`
    return next(e for e in got if e.get("id") == topic)


def _ack(ws, topic: str, seq: int) -> dict:
    ws.send(orjson.dumps({"op": "ack", "topic": topic, "seq": seq, "id": "ack"}).decode())
    deadline = time.monotonic() + 10
    while True:
        for e in orjson.loads(ws.recv(timeout=deadline - time.monotonic())):
            if e.get("id") == "ack":
                return e


def test_acknowledged_entries_leave_redis_and_unacknowledged_ones_come_again_after_a_disconnect(pair):
    """`ack: true` (docs/design/private-queues.md §9): entries written to a connection that then ends stay
    in Redis until acknowledged; the user's next connection, on any node, gets them again with their seqs."""
    a, b = pair
    with ws_as(a, "erin") as ws:
        first = _subscribe_acked(ws, TOPIC)
        assert first["seq"] == 0
        for i in range(5):
            assert b.publish(TOPIC, i, client="erin").json()["seqs"] == [i]
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 5)) == [(i, i) for i in range(5)]
        assert _ack(ws, TOPIC, 1)["result"] == {"topic": TOPIC, "head": 2}
        time.sleep(0.3)  # the node's commit report reaches Redis (QUEUE_ACK)
    with ws_as(b, "erin") as ws:  # the connection ended with 2..4 written, never acknowledged
        again = _subscribe_acked(ws, TOPIC)
        assert (again["epoch"], again["seq"]) == (first["epoch"], 2)
        assert msgs(messages(ws, TOPIC, lambda g: len(msgs(g)) >= 3)) == [(2, 2), (3, 3), (4, 4)]
        assert _ack(ws, TOPIC, 4)["result"] == {"topic": TOPIC, "head": 5}
        time.sleep(0.3)
    with ws_as(a, "erin") as ws:  # nothing acknowledged comes again
        assert _subscribe_acked(ws, TOPIC)["seq"] == 5
