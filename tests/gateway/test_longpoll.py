"""HTTP long-poll transport against a real gateway."""

import time

import pytest

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, wait_for

pytestmark = pytest.mark.timeout(60)


def test_round_trip_commands_by_post_entries_by_poll():
    with run_gateway(longpoll={"poll_timeout_s": 2.0}) as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        session = http.post("/lp").json()["session"]
        assert http.post(f"/lp/{session}", json={"op": "subscribe", "topic": "chat.lp", "id": 1}).status_code == 202
        first = http.get(f"/lp/{session}").json()
        assert first["entries"][0]["type"] == "subscribed"
        http.post(f"/lp/{session}", json=[{"op": "publish", "topic": "chat.lp", "data": "a", "id": 2}])
        second = http.get(f"/lp/{session}", params={"ack": first["batch"]}).json()
        assert [e["type"] for e in second["entries"]] == ["reply", "msg"]
        assert second["batch"] == first["batch"] + 1
        started = time.monotonic()
        empty = http.get(f"/lp/{session}", params={"ack": second["batch"]}).json()
        assert empty == {"batch": None, "entries": []}
        assert 1.5 < time.monotonic() - started < 5


def test_a_poll_waits_and_is_answered_by_a_publish():
    with run_gateway() as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        session = http.post("/lp").json()["session"]
        http.post(f"/lp/{session}", json={"op": "subscribe", "topic": "t"})
        ack = http.get(f"/lp/{session}").json()["batch"]
        pub = Ingest(gw)
        import threading

        threading.Timer(0.3, lambda: pub.send({"topic": "t", "data": "late"})).start()
        started = time.monotonic()
        got = http.get(f"/lp/{session}", params={"ack": ack}).json()
        assert got["entries"] == [{"type": "msg", "topic": "t", "seq": 0, "data": "late"}]
        assert 0.2 < time.monotonic() - started < 3


def test_an_unacknowledged_batch_is_sent_again_and_private_entries_commit_on_ack():
    with run_gateway() as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        created = http.post("/lp", headers={"Authorization": f"Bearer {make_token('lena')}"}).json()
        session, client = created["session"], created["client_id"]
        http.post(f"/lp/{session}", json={"op": "subscribe", "topic": "private.box"})
        ack = http.get(f"/lp/{session}").json()["batch"]
        pub = Ingest(gw)
        pub.send({"topic": "private.box", "client": "lena", "data": "p0"})
        pub.sync()
        lost = http.get(f"/lp/{session}", params={"ack": ack}).json()  # pretend this response was lost
        assert [e["data"] for e in lost["entries"]] == ["p0"]
        again = http.get(f"/lp/{session}", params={"ack": ack}).json()  # same old ack: the batch again
        assert again == lost
        queued = gw.call(lambda: len(gw.hub.scheduler.engine.client(client).subs["private.box"].queue))
        assert queued == 1  # not committed while unacknowledged
        pub.send({"topic": "private.box", "client": "lena", "data": "p1"})
        pub.sync()
        nxt = http.get(f"/lp/{session}", params={"ack": lost["batch"]}).json()
        assert [e["data"] for e in nxt["entries"]] == ["p1"]
        queued = gw.call(lambda: len(gw.hub.scheduler.engine.client(client).subs["private.box"].queue))
        assert queued == 1  # p0 committed and gone; p1 outstanding


def test_session_expiry_frees_everything():
    with run_gateway(longpoll={"session_ttl_s": 0.5}) as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        created = http.post("/lp").json()
        session = created["session"]
        http.post(f"/lp/{session}", json={"op": "subscribe", "topic": "t"})
        # watched on the gateway's own state, not by polling /lp (a poll would keep the session alive)
        wait_for(
            lambda: not gw.call(lambda: gw.hub.scheduler.engine.has_client(created["client_id"])), what="the session's expiry"
        )
        assert http.get(f"/lp/{session}").status_code == 404
        assert gw.call(lambda: len(gw.hub.scheduler.engine.topic("t").subs)) == 0


def test_bad_requests_get_json_errors():
    with run_gateway() as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        assert http.get("/lp/nope").json()["error"]["code"] == "unknown_session"
        session = http.post("/lp").json()["session"]
        r = http.post(f"/lp/{session}", content=b"{oops")
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
        r = http.get(f"/lp/{session}", params={"ack": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_ack"
        r = http.post(f"/lp/{session}", content=b"x" * 70000)
        assert r.status_code == 413
        assert http.delete(f"/lp/{session}").status_code == 204
        assert http.get(f"/lp/{session}").status_code == 404
