"""Presence on one node (docs/integration.md, "Presence"): `presence` / `presence_stats` answers, join/leave
entries, who may ask, counts only above limits.presence_max_members, and the admin endpoint. Real gateway,
real WebSocket clients."""

from __future__ import annotations

import pytest

from core import TopicConfig
from gateway.testing import make_token
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, ws_connect

RULES = {
    "rules": [
        {"pattern": "room.*", "anonymous": True, "presence": True, "join_leave": True},
        {"pattern": "quiet.*", "anonymous": True, "presence": True},
        {"pattern": "plain.*", "anonymous": True},
        {"pattern": "secret.*", "presence": True},
    ]
}


def answer(ws, request_id: str) -> dict:
    got = collect(ws, lambda g: any(e.get("id") == request_id and e["type"] in ("reply", "error") for e in g))
    return next(e for e in got if e.get("id") == request_id and e["type"] in ("reply", "error"))


def subscribed(ws, topic: str) -> None:
    send(ws, op="subscribe", topic=topic, id=f"s-{topic}")
    collect(ws, lambda g: any(e["type"] == "subscribed" and e["topic"] == topic for e in g))


def whoami(ws) -> str:
    send(ws, op="rpc", method="whoami", id="who")
    return answer(ws, "who")["result"]["client_id"]


def test_members_counts_join_leave_and_the_admin_endpoint():
    with (
        run(limits={"presence_max_members": 10}) as gw,
        ws_connect(gw) as a,
        ws_connect(gw, query="?token=" + make_token("alice", info={"name": "Alice"})) as b,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
    ):
        a_id, b_id = whoami(a), whoami(b)
        subscribed(a, "room.1")
        subscribed(b, "room.1")
        # A is told of B's join; B is not told of its own
        got = collect(a, lambda g: any(e["type"] == "join" for e in g))
        assert [e for e in got if e["type"] == "join"] == [{"type": "join", "topic": "room.1", "user": "alice", "client": b_id}]
        send(b, op="presence", topic="room.1", id="p")
        result = answer(b, "p")["result"]
        assert (result["topic"], result["clients"], result["users"]) == ("room.1", 2, 2)
        assert sorted(result["members"], key=lambda m: m["client"] != a_id) == [
            {"user": None, "client": a_id, "info": None},
            {"user": "alice", "client": b_id, "info": {"name": "Alice"}},
        ]
        send(a, op="presence_stats", topic="room.1", id="s")
        assert answer(a, "s")["result"] == {"topic": "room.1", "clients": 2, "users": 2}
        r = http.get("/api/topics/room.1/presence")
        assert r.status_code == 200 and r.json()["clients"] == 2 and len(r.json()["members"]) == 2
        # leave on unsubscribe, then on disconnect
        send(b, op="unsubscribe", topic="room.1")
        got = collect(a, lambda g: any(e["type"] == "leave" for e in g))
        assert [e for e in got if e["type"] == "leave"] == [{"type": "leave", "topic": "room.1", "user": "alice", "client": b_id}]
        subscribed(b, "room.1")
        collect(a, lambda g: any(e["type"] == "join" for e in g))
        b.close()
        got = collect(a, lambda g: any(e["type"] == "leave" for e in g))
        assert [e["client"] for e in got if e["type"] == "leave"] == [b_id]
        assert http.get("/api/topics/room.1/presence").json() == {
            "topic": "room.1",
            "clients": 1,
            "users": 1,
            "members": [{"user": None, "client": a_id, "info": None}],
        }
        # a topic without join_leave: members, but no entries
        with ws_connect(gw) as c:
            subscribed(a, "quiet.1")
            subscribed(c, "quiet.1")
            send(a, op="presence_stats", topic="quiet.1", id="q")
            got = collect(a, lambda g: any(e.get("id") == "q" for e in g))
            assert not [e for e in got if e["type"] in ("join", "leave")]
            assert answer_in(got, "q")["result"]["clients"] == 2
        # deleting the topic: no members left
        assert http.delete("/api/topics/room.1").status_code == 200
        assert http.get("/api/topics/room.1/presence").json()["clients"] == 0


def answer_in(got: list[dict], request_id: str) -> dict:
    return next(e for e in got if e.get("id") == request_id)


def test_who_may_ask_and_topics_without_presence():
    with run() as gw, ws_connect(gw) as ws, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        send(ws, op="presence", topic="plain.1", id="plain")
        assert answer(ws, "plain")["code"] == "forbidden"
        send(ws, op="presence", topic="secret.1", id="secret")  # may not subscribe there: may not ask
        assert answer(ws, "secret")["code"] == "forbidden"
        send(ws, op="presence_stats", topic="nowhere", id="none")
        assert answer(ws, "none")["code"] == "unknown_topic"
        r = http.get("/api/topics/plain.1/presence")
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
        assert http.get("/api/topics/nowhere/presence").status_code == 404
    with run() as gw, ws_connect(gw, query="?token=" + make_token("bob", subscribe=["secret.*"])) as ws:
        send(ws, op="presence", topic="secret.1", id="ok")
        assert answer(ws, "ok")["result"] == {"topic": "secret.1", "clients": 0, "users": 0, "members": []}


def test_counts_only_and_no_join_leave_above_the_bound():
    carol = "?token=" + make_token("carol")
    with (
        run(limits={"presence_max_members": 2}) as gw,
        ws_connect(gw) as a,
        ws_connect(gw) as b,
        ws_connect(gw, query=carol) as c,
        ws_connect(gw, query=carol) as d,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
    ):
        for ws in (a, b):
            subscribed(ws, "room.big")
        got = collect(a, lambda g: any(e["type"] == "join" for e in g))  # B's join (2 subscribers)
        subscribed(c, "room.big")  # 3 subscribers, then 4 > 2: nobody is told
        subscribed(d, "room.big")
        send(a, op="presence", topic="room.big", id="p")
        got += collect(a, lambda g: any(e.get("id") == "p" for e in g))
        joins = [e["client"] for e in got if e["type"] == "join"]
        assert len(joins) == 1
        assert answer_in(got, "p")["result"] == {"topic": "room.big", "clients": 4, "users": 3, "members": None}
        assert http.get("/api/topics/room.big/presence").json()["members"] is None


@pytest.mark.unit
@pytest.mark.parametrize("settings", [{"presence": "yes"}, {"join_leave": True}, {"kind": "private", "presence": True}])
def test_bad_presence_settings(settings):
    with pytest.raises(ValueError):
        TopicConfig(**settings)


def run(**overrides):
    from gateway.testing import run_gateway

    return run_gateway(topics=RULES, **overrides)
