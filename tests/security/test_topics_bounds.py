"""Topics a client can make the gateway hold are bounded (issue 24, topics findings), black-box over real
sockets: creations per address across reconnects and in total, retained junk reclaimed, one topic-name
grammar for every transport, one owner namespace for private queues, bulk admin publishes bounded."""

from __future__ import annotations

import json
import socket
import time

import pytest
from websockets.sync.client import connect

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, auth, collect, recv_entries, send, wait_for

pytestmark = pytest.mark.timeout(60)


def ws_from(gw, source: str = "127.0.0.1", query: str = ""):
    """A WebSocket client whose connection comes from `source` (any 127/8 address reaches loopback)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", gw.http_port))
    return connect(gw.ws_url + query, sock=sock, open_timeout=5, max_size=None, compression=None)


def answers(ws, count: int) -> list[dict]:
    """The next `count` answers to commands (replies and errors with an id)."""
    got = collect(ws, lambda g: len([e for e in g if e.get("id") is not None]) >= count)
    return [e for e in got if e.get("id") is not None]


def publish_new_topics(ws, prefix: str, count: int) -> list[str]:
    """Publish once to `count` new topics; the answer of each: "ok" or the error code."""
    for i in range(count):
        send(ws, op="publish", topic=f"chat.{prefix}{i}", data=i, id=i)
    return ["ok" if e["type"] == "reply" else e["code"] for e in sorted(answers(ws, count), key=lambda e: e["id"])]


def test_topic_creations_are_bounded_per_address_across_reconnects():
    limits = {"limits": {"max_created_topics": 100, "topic_create_burst": 30, "topic_create_rate": 0.0}}
    with run_gateway(**limits) as gw:
        with ws_from(gw) as first:
            assert publish_new_topics(first, "a", 20) == ["ok"] * 20
        with ws_from(gw) as again:  # a reconnect does not start a new budget: the address has 10 left
            assert publish_new_topics(again, "b", 20) == ["ok"] * 10 + ["too_many_topics"] * 10
            # publishing to a topic that exists is no creation
            assert publish_new_topics(again, "a", 5) == ["ok"] * 5
        with ws_from(gw, "127.0.0.2") as other:  # another address has its own budget
            assert publish_new_topics(other, "c", 5) == ["ok"] * 5
        metrics = web.get(f"{gw.http_url}/metrics").text
        assert 'fanout_topic_creations_refused_total{bound="address"} 10.0' in metrics


def test_client_creations_stop_at_the_total_bound_but_operators_go_on():
    with run_gateway(limits={"max_client_topics": 5}) as gw, ws_from(gw) as client:
        assert publish_new_topics(client, "t", 7) == ["ok"] * 5 + ["too_many_topics"] * 2
        with web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as api:
            assert api.post("/api/topics/chat.by-operator/publish", json={"data": 1}).status_code == 200


def test_retained_junk_topics_are_reclaimed_after_the_history_ttl():
    limits = {"limits": {"topic_ttl_s": 0.2, "topic_history_ttl_s": 0.8}}
    with (
        run_gateway(**limits) as gw,
        ws_from(gw) as attacker,
        ws_from(gw) as reader,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as api,
    ):
        assert publish_new_topics(attacker, "junk", 30) == ["ok"] * 30  # each retains its message
        send(reader, op="subscribe", topic="chat.junk0", id="s")
        assert recv_entries(reader)[0]["type"] == "subscribed"
        assert api.post("/api/topics", json={"name": "chat.operator"}).status_code == 201
        assert api.post("/api/topics/chat.operator/publish", json={"data": 1}).status_code == 200

        def names():
            return {t["name"] for t in api.get("/api/topics").json()["topics"]}

        # the 29 unused ones go (with their history); a subscribed one and an operator's stay
        assert wait_for(lambda: names() == {"chat.junk0", "chat.operator"}, "reclaim", timeout=10)
        # a topic published to again is kept while publishes go on
        for _ in range(6):  # 1.5 s: past the history TTL (0.8 s) by far
            assert publish_new_topics(attacker, "busy", 1) == ["ok"]
            time.sleep(0.25)
        assert "chat.busy0" in names()
        assert wait_for(lambda: "chat.busy0" not in names(), "reclaim after the publishes", timeout=10)


BAD_NAMES = ["chat.a}:qc:b", "chat.{x}", "chat.a b", "chat.tab\t", "chat.nl\n", "chat.ls\u2028", "chat.nul\x00"]


@pytest.fixture(scope="module")
def shared():
    """One default gateway for the two tests that need nothing else (each its own topics)."""
    with run_gateway() as gw:
        yield gw


def test_topic_names_follow_one_grammar_on_every_transport(shared):
    gw = shared
    with ws_from(gw) as client, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as api:
        for i, name in enumerate(BAD_NAMES):
            send(client, op="subscribe", topic=name, id=f"s{i}")
            send(client, op="publish", topic=name, data=1, id=f"p{i}")
        got = answers(client, 2 * len(BAD_NAMES))
        assert {e["code"] for e in got} == {"bad_topic"}, got
        ingest = Ingest(gw)
        for name in BAD_NAMES:
            ingest.send({"topic": name, "data": 1})
        synced = ingest.sync()
        assert synced["refused"] == len(BAD_NAMES)
        for name in ("chat.a}:qc:b", "chat.{x}"):
            reply = api.post("/api/topics", json={"name": name})
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "bad_topic"
        # what the grammar allows: printable names with `:`, `/`, `@`, non-ASCII letters
        for i, name in enumerate(["chat.a:qc:b", "chat.room/1@x", "chat.café"]):
            send(client, op="subscribe", topic=name, id=f"ok{i}")
        assert {e["type"] for e in answers(client, 3)} == {"subscribed"}


def test_a_token_subject_cannot_be_an_anonymous_client_id():
    rules = [
        {"pattern": "inbox.*", "kind": "private", "anonymous": True},
        {"pattern": "chat.*", "kind": "ring", "anonymous": True, "client_publish": True},
    ]
    with run_gateway(topics={"rules": rules}) as gw, ws_from(gw) as anon, ws_from(gw) as mallory:
        send(anon, op="rpc", method="whoami", id="w")
        anon_id = answers(anon, 1)[0]["result"]["client_id"]
        send(anon, op="subscribe", topic="inbox.x", id="s")
        assert answers(anon, 1)[0]["type"] == "subscribed"
        # a token whose sub is the anonymous client's id: refused, on `auth` and on the handshake
        send(mallory, op="auth", token=make_token(anon_id), id="a")
        assert answers(mallory, 1)[0]["code"] == "bad_token"
        with ws_from(gw, query=f"?token={make_token(anon_id)}") as forged:
            with pytest.raises(Exception) as closed:
                forged.recv(timeout=5)
            assert getattr(closed.value, "rcvd", None) is not None and closed.value.rcvd.code == 4001
        send(mallory, op="subscribe", topic="inbox.x", id="m")  # mallory's own queue (its own id)
        assert answers(mallory, 1)[0]["type"] == "subscribed"
        ingest = Ingest(gw)
        ingest.send({"topic": "inbox.x", "client": anon_id, "data": "for the anonymous client"})
        assert ingest.sync()["accepted"] == 1
        got = collect(anon, lambda g: any(e["type"] == "msg" for e in g))
        assert [e for e in got if e["type"] == "closed"] == []  # never taken over
        assert [e["data"] for e in got if e["type"] == "msg"] == ["for the anonymous client"]
        with pytest.raises(TimeoutError):
            mallory.recv(timeout=0.3)


def test_bulk_admin_publishes_are_bounded():
    with (
        run_gateway(admin={"max_publish_messages": 100}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as api,
    ):
        reply = api.post("/api/topics/chat.bulk/publish", json={"messages": list(range(101))})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
        reply = api.post("/api/topics/chat.bulk/publish", json={"messages": list(range(100))})
        assert reply.status_code == 200 and reply.json()["seqs"] == list(range(100))


def test_a_bulk_body_of_millions_of_tiny_messages_is_refused_by_its_size_before_it_is_decoded(shared):
    """admin.max_body_bytes (2 MiB) is sized from admin.max_publish_messages: a body over it is refused from
    its Content-Length, before it is read or decoded (a 6 MB body of 2 M messages held the loop ~45 ms
    decoding it before the message count refused it). What the bound is sized for still goes through."""
    gw = shared
    with web.Client(base_url=gw.http_url, headers=auth(gw), timeout=30) as api:
        huge = json.dumps({"messages": [0] * 1_000_000}).encode()  # 3 MB, 1 M messages
        reply = api.post("/api/topics/chat.bulk/publish", content=huge, headers={"Content-Type": "application/json"})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
        assert reply.json()["error"]["message"] == f"body of {len(huge)} bytes exceeds 2097152 bytes (admin.max_body_bytes)"
        typical = [
            {
                "sym": "EURUSD",
                "bid": 1.0842 + i / 1e6,
                "ask": 1.0843,
                "ts": 1700000000000 + i,
                "venue": "primary",
                "note": "x" * 60,
            }
            for i in range(10_000)
        ]
        body = json.dumps({"messages": typical}).encode()
        assert 1_200_000 < len(body) < 2_097_152
        reply = api.post("/api/topics/chat.bulk/publish", content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200 and len(reply.json()["seqs"]) == 10_000
        one = {"data": "x" * (1_048_576 - 200)}  # one message of about scheduler.max_message_bytes
        assert api.post("/api/topics/chat.one/publish", json=one).status_code == 200
