"""Topic and backlog bounds with a real Redis (issue 24): a publish to a topic with no local subscriber is no
creation, creations are bounded per address across reconnects and cluster-wide, topic names cannot reach
other keys, and publishes waiting for a stalled Redis are bounded in bytes."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time

import httpx
import pytest

from gateway.testing import make_token
from tests.cluster.cluster_helpers import TOKEN, collect, messages, subscribe
from tests.gateway.gw_helpers import send

pytestmark = pytest.mark.timeout(90)


def answers(ws, count: int) -> list[dict]:
    got = collect(ws, lambda g: len([e for e in g if e.get("id") is not None]) >= count)
    return sorted([e for e in got if e.get("id") is not None], key=lambda e: e["id"])


def publish_to(ws, names: list[str]) -> list[str]:
    for i, name in enumerate(names):
        send(ws, op="publish", topic=name, data=i, id=i)
    return ["ok" if e["type"] == "reply" else e["code"] for e in answers(ws, len(names))]


def test_publishes_to_a_topic_without_local_subscriber_are_not_creations(nodes):
    node = nodes.start("a", limits={"max_created_topics": 3})
    with node.ws() as ws:
        assert publish_to(ws, ["t.same"] * 10) == ["ok"] * 10  # one creation, nine publishes
        assert publish_to(ws, ["t.b", "t.c", "t.d", "t.same"]) == ["ok", "ok", "too_many_topics", "ok"]
    with node.ws() as ws:  # another connection: publishes to topics that exist in Redis create nothing
        assert publish_to(ws, ["t.b", "t.c", "t.same"]) == ["ok"] * 3


def test_creations_are_bounded_per_address_across_reconnects_and_in_the_cluster(nodes):
    limits = {"topic_create_burst": 3, "topic_create_rate": 0.0}
    a = nodes.start("a", limits=limits, broker={"max_topics": 5})
    b = nodes.start("b", broker={"max_topics": 5})
    with a.ws() as ws:
        assert publish_to(ws, ["p.0", "p.1", "p.2"]) == ["ok"] * 3
    with a.ws() as ws:  # a reconnect: the address has used its burst, on publish and subscribe alike
        assert publish_to(ws, ["p.3", "p.0"]) == ["too_many_topics", "ok"]
        send(ws, op="subscribe", topic="p.4", id="s")
        assert collect(ws, lambda g: any(e.get("id") == "s" for e in g))[-1]["code"] == "too_many_topics"
        assert subscribe(ws, "p.1")["type"] == "subscribed"  # exists: no creation
    with b.ws() as ws:  # the cluster holds 3; node b's own clients take it to its bound of 5
        assert publish_to(ws, ["q.0", "q.1", "q.2"]) == ["ok", "ok", "too_many_topics"]
    refused = httpx.post(
        f"{a.http_url}/api/topics/r.0/publish", json={"data": 1}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "too_many_topics"
    assert 'fanout_topic_creations_refused_total{bound="cluster"}' in httpx.get(f"{b.http_url}/metrics").text


SECRET = "cluster-jwt-secret-of-at-least-32-bytes!"


@pytest.fixture(scope="module")
def authed(module_nodes):
    """A node with tokens (anonymous clients still welcome) for the tests that need no other override."""
    return module_nodes.start("authed", auth={"jwt_secret": SECRET})


def test_topic_names_cannot_reach_other_keys(authed):
    node = authed
    with node.ws() as ws:
        for i, name in enumerate(["x}:qc:y", "{x}", "x}:c"]):
            send(ws, op="subscribe", topic=name, id=f"s{i}")
            send(ws, op="publish", topic=name, data=1, id=f"p{i}")
        got = collect(ws, lambda g: len([e for e in g if e.get("id") is not None]) >= 6)
        assert {e["code"] for e in got if e.get("id") is not None} == {"bad_topic"}
        assert node.publish("x}:qc:y", 1).json()["error"]["code"] == "bad_topic"
        # names with `:qc:` and other punctuation are topics like any other, and their messages arrive
        assert subscribe(ws, "x:qc:y")["type"] == "subscribed"
        assert node.publish("x:qc:y", "live").status_code == 200
        assert [e["data"] for e in messages(ws, "x:qc:y", lambda g: len(g) >= 1)] == ["live"]


def test_a_token_subject_cannot_be_an_anonymous_client_id(authed):
    node = authed
    with node.ws() as anon, node.ws() as mallory:
        send(anon, op="rpc", method="whoami", id="w")
        anon_id = answers(anon, 1)[0]["result"]["client_id"]
        send(mallory, op="auth", token=make_token(anon_id, secret=SECRET), id="a")
        assert answers(mallory, 1)[0]["code"] == "bad_token"
        send(mallory, op="auth", token=make_token("alice", secret=SECRET), id="b")
        assert answers(mallory, 1)[0]["result"]["user"] == "alice"


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _send_in_background(sock: socket.socket, data: bytes) -> threading.Thread:
    """`sendall` in a thread: a gateway that stops reading makes it block (TCP back-pressure)."""
    thread = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    thread.start()
    return thread


class Lines:
    """The ingest's answer lines, read from the socket itself (so a wait for none can time out)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def next(self, timeout: float = 30) -> dict | None:
        """The next line, or None when none came within `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = self.sock.recv(65536)
            assert chunk, "the gateway closed the connection"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def test_a_stalled_redis_holds_the_ingest_back_and_refuses_other_publishes_past_the_byte_bound(nodes, redis_server):
    """While the publishes waiting for Redis hold broker.max_pending_bytes, the ingest holds its records
    (no broker_unavailable line; the connection is not read: TCP back-pressure) and lands every one once
    Redis answers; the admin API keeps its documented answer, 503 broker_unavailable with Retry-After."""
    node = nodes.start("a", broker={"max_pending_bytes": 262144})
    payload = "x" * 20000
    records = b"".join(json.dumps({"topic": "stall", "data": payload}).encode() + b"\n" for _ in range(100))
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", node.ingest_port), timeout=30) as ingest:
            sender = _send_in_background(ingest, records + b'{"sync": 1}\n')
            lines = Lines(ingest)
            # before: the first record past the bound was answered broker_unavailable at once
            assert lines.next(1.0) is None, "a record was answered while Redis stalls"
            pending = metric(node.http_url, "fanout_broker_pending_bytes")
            assert 0 < pending <= 262144
            refused = httpx.post(
                f"{node.http_url}/api/topics/stall/publish",
                json={"data": "y" * 300000},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "broker_unavailable"
            assert "max_pending_bytes" in refused.json()["error"]["message"]
            assert metric(node.http_url, "fanout_broker_backlog_refused_total") >= 1
            os.kill(redis_server.proc.pid, signal.SIGCONT)  # within the 5 s after which Redis counts as lost
            assert lines.next() == {"type": "synced", "id": 1, "accepted": 100, "refused": 0}
            sender.join(10)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert metric(node.http_url, "fanout_broker_pending_bytes") == 0


def test_while_redis_is_lost_an_ingest_connection_gets_one_refusal_then_waits_for_it(nodes, redis_server):
    """Redis lost: the ingest answers one record broker_unavailable and reads nothing more from that
    connection until Redis is back (a publisher flooding meanwhile costs no CPU); then the rest lands."""
    node = nodes.start("a")
    assert node.publish("lost", "first").status_code == 200
    redis_server.stop()
    deadline = time.monotonic() + 30
    while node.publish("lost", "x").status_code != 503:  # the node saw Redis go
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", node.ingest_port), timeout=30) as ingest:
        records = b"".join(json.dumps({"topic": "lost", "data": i}).encode() + b"\n" for i in range(50))
        ingest.sendall(records + b'{"sync": 1}\n')
        lines = Lines(ingest)
        line = lines.next()
        assert line is not None and line["line"] == 1 and line["code"] == "broker_unavailable"
        # before: each of the 50 was answered broker_unavailable at once, then the sync
        assert lines.next(1.0) is None, "the connection was read on while Redis is lost"
        redis_server.start()
        assert lines.next() == {"type": "synced", "id": 1, "accepted": 49, "refused": 1}
