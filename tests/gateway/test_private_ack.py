"""Acknowledged private subscriptions (`subscribe` with `ack: true`, the `ack` command; docs/protocol.md,
docs/design/private-queues.md §9) against a real gateway, with raw WebSocket and SSE clients.

Without `ack`, entries leave a private queue once their frame is handed to the socket: a connection that
then dies with them in flight loses them, and the next connection of the same user starts after them (the
silent loss this mode exists for; that behaviour stays, for clients that do not opt in). With `ack`, they
stay until the client acknowledges them: the next connection gets every un-acknowledged entry again, in
order, with the same seqs, and never one that was acknowledged.
"""

import pytest

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, wait_for, ws_connect
from tests.gateway.sse_client import SseClient

pytestmark = pytest.mark.timeout(60)

TOPIC = "private.inbox"


def msgs(entries):
    return [e for e in entries if e["type"] == "msg"]


def publish(http, *data, user="alice"):
    r = http.post(f"/api/topics/{TOPIC}/publish", json={"messages": list(data), "client": user})
    assert r.status_code == 200, r.text
    return r.json()["seqs"]


def subscribed(ws, **extra):
    """The answer to a subscribe, and the entries that came with it."""
    send(ws, op="subscribe", topic=TOPIC, id="s", **extra)
    got = collect(ws, lambda g: any(e["type"] in ("subscribed", "error") for e in g))
    (answer,) = [e for e in got if e["type"] in ("subscribed", "error")]
    return answer, got


def queued(http):
    return http.get(f"/api/topics/{TOPIC}").json()["queued"]


def test_without_ack_written_entries_are_gone_for_the_next_connection():
    """The loss the chaos run found, unchanged for clients that do not opt in: what was written to a
    connection that is then abandoned does not come to the connection taking the queue over."""
    token = make_token("alice")
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={token}") as first,
    ):
        assert subscribed(first)[0]["seq"] == 0
        assert publish(http, "a", "b", "c") == [0, 1, 2]
        assert [e["seq"] for e in msgs(collect(first, lambda g: len(msgs(g)) == 3))] == [0, 1, 2]
        wait_for(lambda: queued(http) == 0, "the written entries to leave the queue")
        with ws_connect(gw, query=f"?token={token}") as second:  # the first is abandoned, still open
            answer, got = subscribed(second)
            assert answer["seq"] == 3 and not msgs(got)  # the queue starts after what the first connection was written
            assert publish(http, "d") == [3]
            assert [e["seq"] for e in msgs(collect(second, msgs))] == [3]
            assert {"type": "closed", "topic": TOPIC, "reason": "taken_over"} in collect(
                first, lambda g: any(e["type"] == "closed" for e in g)
            )


def test_with_ack_unacknowledged_entries_come_again_to_the_next_connection():
    token = make_token("alice")
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={token}") as first,
    ):
        assert subscribed(first, ack=True)[0]["seq"] == 0
        assert publish(http, "a", "b", "c", "d", "e") == [0, 1, 2, 3, 4]
        got = msgs(collect(first, lambda g: len(msgs(g)) == 5))
        assert [(e["seq"], e["data"]) for e in got] == [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (4, "e")]
        send(first, op="ack", topic=TOPIC, seq=1, id=7)  # the application handled a and b
        assert {"type": "reply", "id": 7, "result": {"topic": TOPIC, "head": 2}} in collect(
            first, lambda g: any(e["type"] == "reply" for e in g)
        )
        assert queued(http) == 3  # written, not acknowledged: still queued
        # The first connection stalls (a proxy, a client that timed out): the client opens another one.
        with ws_connect(gw, query=f"?token={token}") as second:
            answer, got = subscribed(second, ack=True)
            assert answer["seq"] == 2  # the first un-acknowledged entry
            again = msgs(got + collect(second, lambda g: len(msgs(got + g)) == 3))
            assert [(e["seq"], e["data"]) for e in again] == [(2, "c"), (3, "d"), (4, "e")]
            send(second, op="ack", topic=TOPIC, seq=3)  # no id: no answer
            assert publish(http, "f") == [5]
            after = collect(second, msgs)
            assert [(e["seq"], e["data"]) for e in msgs(after)] == [(5, "f")]
            assert not [e for e in after if e["type"] in ("reply", "error")]
            wait_for(lambda: queued(http) == 2, "the ack of seq 3 to commit")  # 4 and 5 stay
            send(second, op="ack", topic=TOPIC, seq=5, id=8)
            assert {"type": "reply", "id": 8, "result": {"topic": TOPIC, "head": 6}} in collect(
                second, lambda g: any(e["type"] == "reply" for e in g)
            )
            assert queued(http) == 0
        assert any(
            e["type"] == "closed" and e["reason"] == "taken_over"
            for e in collect(first, lambda g: any(e["type"] == "closed" for e in g))
        )


def test_ack_answers_and_errors():
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={make_token('alice')}") as ws,
    ):
        assert subscribed(ws, ack=True)[0]["type"] == "subscribed"
        publish(http, "a", "b")
        collect(ws, lambda g: len(msgs(g)) == 2)

        def answer_to(**command):
            send(ws, **command)
            (entry,) = [
                e
                for e in collect(ws, lambda g: any(e["type"] in ("reply", "error") for e in g))
                if e["type"] in ("reply", "error")
            ]
            return entry

        assert answer_to(op="ack", topic=TOPIC, seq=2, id=1)["code"] == "bad_ack"  # not delivered yet
        assert answer_to(op="ack", topic=TOPIC, seq=0, id=2)["result"] == {"topic": TOPIC, "head": 1}
        assert answer_to(op="ack", topic=TOPIC, seq=0, id=3)["result"] == {"topic": TOPIC, "head": 1}  # no-op
        assert answer_to(op="ack", topic="private.other", seq=0, id=4)["code"] == "not_subscribed"
        assert answer_to(op="ack", topic=TOPIC, seq=-1, id=5)["code"] == "bad_command"
        assert answer_to(op="ack", topic=TOPIC, id=6)["code"] == "bad_command"  # no seq
        send(ws, op="subscribe", topic="chat.room", ack=True, id=7)  # ignored on a ring topic
        assert collect(ws, lambda g: any(e["type"] == "subscribed" for e in g))
        assert answer_to(op="ack", topic="chat.room", seq=0, id=71)["code"] == "bad_ack"
        send(ws, op="subscribe", topic="private.plain", id=8)
        assert collect(ws, lambda g: any(e["type"] == "subscribed" for e in g))
        assert answer_to(op="ack", topic="private.plain", seq=0, id=9)["code"] == "bad_ack"  # made without ack


def test_the_window_is_the_queue_bounds():
    """Entries awaiting an ack count against the queue's bounds: a publisher waits until the client acks."""
    rules = [{"pattern": "private.*", "kind": "private", "anonymous": False, "max_count": 2}]
    with (
        run_gateway(admin={"publish_timeout_s": 0.3}, topics={"rules": rules}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={make_token('alice')}") as ws,
    ):
        subscribed(ws, ack=True)
        assert publish(http, "a", "b") == [0, 1]
        collect(ws, lambda g: len(msgs(g)) == 2)
        r = http.post(f"/api/topics/{TOPIC}/publish", json={"data": "c", "client": "alice"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        send(ws, op="ack", topic=TOPIC, seq=0)
        assert wait_for(
            lambda: http.post(f"/api/topics/{TOPIC}/publish", json={"data": "c", "client": "alice"}).status_code == 200,
            "room after the ack",
        )
        assert [e["seq"] for e in msgs(collect(ws, msgs))] == [2]


def test_sse_acks_by_post():
    token = make_token("alice")
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        SseClient(gw, f"?token={token}") as sse,
    ):
        secret = sse.session()["session"]
        assert http.post(f"/sse/{secret}", json={"op": "subscribe", "topic": TOPIC, "ack": True}).status_code == 202
        assert sse.collect(lambda g: any(e["type"] == "subscribed" for e in g))
        publish(http, "a", "b", "c")
        assert [e["seq"] for e in msgs(sse.collect(lambda g: len(msgs(g)) == 3))] == [0, 1, 2]
        assert http.post(f"/sse/{secret}", json={"op": "ack", "topic": TOPIC, "seq": 0}).status_code == 202
        wait_for(lambda: queued(http) == 2, "the ack to commit")
        with ws_connect(gw, query=f"?token={token}") as ws:  # the same user takes the queue over
            answer, got = subscribed(ws, ack=True)
            assert answer["seq"] == 1
            assert [e["seq"] for e in msgs(got + collect(ws, lambda g: len(msgs(got + g)) == 2))] == [1, 2]
