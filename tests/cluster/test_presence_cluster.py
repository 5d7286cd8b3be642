"""Presence across two nodes on one real Redis (docs/integration.md, "Presence", "Cluster"): members seen from
either node, join/leave entries across nodes, and a node killed with -9 whose members leave within the
heartbeat's TTL (gateway/broker/presence_store.py: 3 s)."""

from __future__ import annotations

import time

from cluster_helpers import collect, send, subscribe
from gw_helpers import wait_for

from gateway.broker.presence_store import ALIVE_TTL_MS

RULE = {"rule": {"presence": True, "join_leave": True}}


def ask(ws, op: str, topic: str, request_id: str) -> dict:
    send(ws, op=op, topic=topic, id=request_id)
    got = collect(ws, lambda g: any(e.get("id") == request_id for e in g))
    return next(e for e in got if e.get("id") == request_id)["result"]


def client_id(ws) -> str:
    send(ws, op="rpc", method="whoami", id="who")
    got = collect(ws, lambda g: any(e.get("id") == "who" for e in g))
    return next(e for e in got if e.get("id") == "who")["result"]["client_id"]


def test_members_and_join_leave_across_nodes_and_a_killed_node_leaves(nodes):
    a, b = nodes.start("a", **RULE), nodes.start("b", **RULE)
    with a.ws() as on_a, b.ws() as on_b, b.ws() as on_b2:
        a_id, b_id, b2_id = client_id(on_a), client_id(on_b), client_id(on_b2)
        subscribe(on_a, "room")
        subscribe(on_b, "room")  # A is told, through Redis
        got = collect(on_a, lambda g: any(e["type"] == "join" for e in g))
        assert [e for e in got if e["type"] == "join"] == [{"type": "join", "topic": "room", "user": None, "client": b_id}]
        result = ask(on_a, "presence", "room", "p")
        assert (result["clients"], result["users"]) == (2, 2)
        assert sorted(m["client"] for m in result["members"]) == sorted([a_id, b_id])
        assert a.api("/topics/room/presence")["clients"] == b.api("/topics/room/presence")["clients"] == 2
        send(on_b, op="unsubscribe", topic="room")
        got = collect(on_a, lambda g: any(e["type"] == "leave" for e in g))
        assert [e["client"] for e in got if e["type"] == "leave"] == [b_id]
        assert ask(on_a, "presence_stats", "room", "s") == {"topic": "room", "clients": 1, "users": 1}
        # a member on B, then B is killed: it leaves every answer within the heartbeat's TTL
        subscribe(on_b2, "room")
        wait_for(lambda: a.api("/topics/room/presence")["clients"] == 2, "B2 a member")
        b.kill9()
        killed = time.monotonic()
        wait_for(lambda: a.api("/topics/room/presence")["clients"] == 1, "B's members gone", timeout=10)
        assert time.monotonic() - killed < ALIVE_TTL_MS / 1000 + 1.5
        assert a.api("/topics/room/presence")["members"] == [{"user": None, "client": a_id, "info": None}]
        assert b2_id
