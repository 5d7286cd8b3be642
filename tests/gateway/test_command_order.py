"""Issue 34, item 17: a connection's commands take effect in the order sent, also when one waits for a
backend hook (`proxy_subscribe` / `proxy_publish`): a command on a topic with a hooked command of the same
connection pending waits behind it; commands on other topics, and rpc, go on. Real gateway, real slow
backend (tests/gateway/hook_backend.py), real WebSocket clients."""

from __future__ import annotations

import json

from gateway.testing import run_gateway
from tests.gateway.gw_helpers import collect, recv_entries, send, ws_connect

RULES = [
    {
        "pattern": "guarded.*",
        "kind": "ring",
        "anonymous": True,
        "client_publish": True,
        "proxy_subscribe": True,
        "proxy_publish": True,
    },
    {"pattern": "*", "kind": "ring", "anonymous": True, "client_publish": True},
]


def answers(entries: list[dict]) -> list[tuple]:
    """(id, type or error code) of the entries that answer a command, in arrival order."""
    return [(e["id"], e.get("code", e["type"])) for e in entries if e.get("id") is not None]


def frame(ws, *commands: dict) -> None:
    ws.send(json.dumps(list(commands)))


def test_subscribe_then_unsubscribe_in_one_frame_ends_unsubscribed(app):
    app.delays["subscribe"] = 0.3
    with run_gateway(proxy=app.proxy("subscribe"), topics={"rules": RULES}) as gw:
        with ws_connect(gw) as ws:
            frame(ws, {"op": "subscribe", "topic": "guarded.a", "id": 1}, {"op": "unsubscribe", "topic": "guarded.a", "id": 2})
            got = collect(ws, lambda g: len(answers(g)) >= 2)
            assert answers(got) == [(1, "subscribed"), (2, "unsubscribed")]
            (client_id,) = gw.call(lambda: list(gw.hub.clients.conns))
            assert gw.call(lambda: list(gw.hub.scheduler.engine.client(client_id).subs)) == []
            # and the same connection may subscribe again: no `already_subscribed`
            send(ws, op="subscribe", topic="guarded.a", id=3)
            assert answers(collect(ws, lambda g: answers(g))) == [(3, "subscribed")]


def test_a_publish_behind_a_pending_subscribe_reaches_the_subscriber(app):
    app.delays["subscribe"] = 0.3
    with run_gateway(proxy=app.proxy("subscribe", "publish"), topics={"rules": RULES}) as gw:
        with ws_connect(gw) as ws:
            frame(
                ws,
                {"op": "subscribe", "topic": "guarded.b", "id": 1},
                {"op": "publish", "topic": "guarded.b", "data": "hello", "id": 2},
            )
            got = collect(ws, lambda g: any(e["type"] == "msg" for e in g))
            assert answers(got) == [(1, "subscribed"), (2, "reply")]
            assert [e["data"] for e in got if e["type"] == "msg"] == ["hello"]  # subscribed before it landed
            frame(
                ws,
                {"op": "unsubscribe", "topic": "guarded.b", "id": 3},
                {"op": "subscribe", "topic": "guarded.b", "id": 4},
                {"op": "unsubscribe", "topic": "guarded.b", "id": 5},
            )
            got = collect(ws, lambda g: len(answers(g)) >= 3)
            assert answers(got) == [(3, "unsubscribed"), (4, "subscribed"), (5, "unsubscribed")]
            assert [b["topic"] for b in app.received["subscribe"]] == ["guarded.b", "guarded.b"]


def test_other_topics_and_rpc_do_not_wait_and_a_refusal_releases_the_topic(app):
    app.delays["subscribe"] = 0.4
    app.answers["subscribe"] = lambda body: {"error": {"message": "no"}} if body["topic"] == "guarded.no" else {}
    with run_gateway(proxy=app.proxy("subscribe"), topics={"rules": RULES}) as gw:
        with ws_connect(gw) as ws:
            frame(
                ws,
                {"op": "subscribe", "topic": "guarded.no", "id": 1},
                {"op": "unsubscribe", "topic": "guarded.no", "id": 2},
                {"op": "subscribe", "topic": "plain", "id": 3},
                {"op": "rpc", "method": "echo", "params": 4, "id": 4},
                {"op": "publish", "topic": "guarded.no", "data": 5, "id": 5},
            )
            got = collect(ws, lambda g: len(answers(g)) >= 5)
            # the other topic and the rpc at once; then the refused subscribe, and what waited behind it
            assert answers(got) == [(3, "subscribed"), (4, "reply"), (1, "forbidden"), (2, "not_subscribed"), (5, "reply")]


def test_commands_waiting_count_against_the_connections_bound(app):
    app.delays["subscribe"] = 0.3
    with run_gateway(proxy=app.proxy("subscribe", max_calls_per_connection=3), topics={"rules": RULES}) as gw:
        with ws_connect(gw) as ws:
            frame(ws, *[{"op": op, "topic": "guarded.c", "id": i} for i, op in enumerate(["subscribe", "unsubscribe"] * 3)])
            got = collect(ws, lambda g: len(answers(g)) >= 6)
            # one call in flight and two commands behind it: the other three are refused at once
            assert answers(got) == [
                (3, "too_many_calls"),
                (4, "too_many_calls"),
                (5, "too_many_calls"),
                (0, "subscribed"),
                (1, "unsubscribed"),
                (2, "subscribed"),
            ]
            send(ws, op="unsubscribe", topic="guarded.c", id=6)
            assert answers(recv_entries(ws)) == [(6, "unsubscribed")]
