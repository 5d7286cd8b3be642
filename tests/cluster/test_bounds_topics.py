"""Topic and backlog bounds with a real Redis (issue 24): a publish to a topic with no local subscriber is no
creation, creations are bounded per address across reconnects and cluster-wide, topic names cannot reach
other keys, and publishes waiting for a stalled Redis are bounded in bytes."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest
from cluster_helpers import TOKEN, collect, messages, subscribe
from gw_helpers import send

from gateway.testing import make_token

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
    refused = httpx.post(f"{a.http_url}/api/topics/r.0/publish", json={"data": 1},
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "too_many_topics"
    assert 'fanout_topic_creations_refused_total{bound="cluster"}' in httpx.get(f"{b.http_url}/metrics").text


def test_topic_names_cannot_reach_other_keys(nodes):
    node = nodes.start("a")
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


SECRET = "cluster-jwt-secret-of-at-least-32-bytes!"


def test_a_token_subject_cannot_be_an_anonymous_client_id(nodes):
    node = nodes.start("a", auth={"jwt_secret": SECRET})
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


def test_publishes_waiting_for_a_stalled_redis_are_bounded_in_bytes(nodes, redis_server):
    node = nodes.start("a", broker={"max_pending_bytes": 262144})
    payload = "x" * 20000
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", node.ingest_port), timeout=10) as ingest:
            ingest.sendall(b"".join(json.dumps({"topic": "stall", "data": payload}).encode() + b"\n"
                                    for _ in range(100)))
            reader = ingest.makefile()
            line = json.loads(reader.readline())  # the first refusal comes at once, not after the timeout
            assert line["code"] == "broker_unavailable" and "max_pending_bytes" in line["message"]
            assert metric(node.http_url, "fanout_broker_backlog_refused_total") >= 1
            assert metric(node.http_url, "fanout_broker_pending_bytes") <= 262144
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while node.publish("stall", "after").status_code != 200:  # Redis is back: publishes land again
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert metric(node.http_url, "fanout_broker_pending_bytes") == 0
