"""Issue 34, items 1 and 2 (the command side): one connection's subscribe/unsubscribe commands are rate-bound
(`limits.subscribe_rate` / `subscribe_burst`), and its hook calls in flight are bounded
(`proxy.max_calls_per_connection`), so a flood of either costs other clients nothing. Real gateway, real
backend (tests/gateway/hook_backend.py), real WebSocket clients on loopback."""

from __future__ import annotations

import json
from collections import Counter

from gateway.testing import run_gateway
from tests.gateway.gw_helpers import collect, recv_entries, send, ws_connect
from tests.gateway.sse_client import SseClient

RULES = [
    {"pattern": "room.*", "kind": "ring", "anonymous": True, "presence": True, "join_leave": True},
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


def outcome(entry: dict) -> str:
    return entry["code"] if entry["type"] == "error" else entry["type"]


def test_a_toggling_client_is_rate_limited_and_a_normal_one_is_not():
    with run_gateway(topics={"rules": RULES}, limits={"subscribe_burst": 100}) as gw:
        with ws_connect(gw) as toggler, ws_connect(gw) as member:
            send(member, op="subscribe", topic="room.a", id="m")
            assert recv_entries(member)[0]["type"] == "subscribed"
            # two frames of 50 subscribe/unsubscribe pairs: past the burst (100), `rate_limited`
            pair = [{"op": "subscribe", "topic": "room.a"}, {"op": "unsubscribe", "topic": "room.a"}]
            for _ in range(2):
                toggler.send(json.dumps(pair * 50))
            got = collect(toggler, lambda g: len(g) >= 200, timeout=10)
            counts = Counter(outcome(e) for e in got)
            assert counts["rate_limited"] >= 80, counts  # 100 over the burst, less what refilled meanwhile
            assert counts["subscribed"] + counts["unsubscribed"] + counts["rate_limited"] == 200, counts
            limited = next(e for e in got if outcome(e) == "rate_limited")
            assert "limits.subscribe_rate" in limited["message"]
            # a client subscribing to 60 topics in one frame (and leaving them) is never near the bound
            member.send(json.dumps([{"op": "subscribe", "topic": f"news.{i}"} for i in range(60)]))
            member.send(json.dumps([{"op": "unsubscribe", "topic": f"news.{i}"} for i in range(30)]))
            got = collect(member, lambda g: sum(e["type"] in ("subscribed", "unsubscribed", "error") for e in g) >= 90)
            assert not [e for e in got if e["type"] == "error"]


def test_the_subscribe_bound_is_configurable_and_an_sse_streams_topics_are_not_counted():
    with run_gateway(topics={"rules": RULES}, limits={"subscribe_rate": 0.5, "subscribe_burst": 3}) as gw:
        with ws_connect(gw) as ws:
            ws.send(json.dumps([{"op": "subscribe", "topic": f"t.{i}", "id": i} for i in range(5)]))
            got = collect(ws, lambda g: len(g) >= 5)
            assert [outcome(e) for e in got] == ["subscribed"] * 3 + ["rate_limited"] * 2
            assert got[3]["id"] == 3 and got[3]["message"].startswith("subscribe/unsubscribe above 0.5/s")
        # the topics a stream opens with come in one request, bounded by scheduler.max_subscriptions
        topics = ",".join(f"s.{i}" for i in range(8))
        with SseClient(gw, f"?topics={topics}") as sse:
            sse.session()
            got = sse.collect(lambda g: len(g) >= 8)
            assert [e["type"] for e in got] == ["subscribed"] * 8


def test_an_rpc_flood_through_a_slow_hook_costs_another_client_nothing(app):
    """3,000 rpc from one anonymous WebSocket on a hook answering in 0.5 s: the flooder has at most
    `max_calls_per_connection` (16) in flight, the rest get `too_many_calls` at once, and another client's
    rpc is answered (before: the flood queued on the hook's 64 slots and the other got backend_unavailable)."""
    app.delays["rpc"] = 0.5
    app.answers["rpc"] = lambda body: {"result": body["params"]}
    with run_gateway(proxy=app.proxy("rpc", timeout_s=2.0), topics={"rules": RULES}) as gw:
        with ws_connect(gw) as flooder, ws_connect(gw) as other:
            for frame in range(30):
                flooder.send(
                    json.dumps(
                        [{"op": "rpc", "method": "slow", "params": frame * 100 + i, "id": frame * 100 + i} for i in range(100)]
                    )
                )
            send(other, op="rpc", method="slow", params="mine", id="other")
            assert collect(other, lambda g: g, timeout=5) == [{"type": "reply", "id": "other", "result": "mine"}]
            assert gw.call(lambda: max(c.session.state.hook_calls for c in gw.hub.clients.conns.values())) <= 16
            got = collect(flooder, lambda g: len(g) >= 3000, timeout=10)
            assert Counter(outcome(e) for e in got) == {"too_many_calls": 3000 - 16, "reply": 16}
            assert sorted(e["id"] for e in got if e["type"] == "reply") == list(range(16))
            refused = next(e for e in got if e["type"] == "error")
            assert "proxy.max_calls_per_connection" in refused["message"]
        assert len(app.received["rpc"]) == 17


def test_hooked_subscribes_and_publishes_share_the_bound(app):
    app.delays["subscribe"] = app.delays["publish"] = 0.3
    with run_gateway(proxy=app.proxy("subscribe", "publish", max_calls_per_connection=2), topics={"rules": RULES}) as gw:
        with ws_connect(gw) as ws:
            ws.send(
                json.dumps(
                    [
                        {"op": "subscribe", "topic": "guarded.a", "id": 1},
                        {"op": "publish", "topic": "guarded.b", "data": 1, "id": 2},
                        {"op": "subscribe", "topic": "guarded.c", "id": 3},
                        {"op": "subscribe", "topic": "plain", "id": 4},
                    ]
                )
            )
            got = collect(ws, lambda g: len([e for e in g if e.get("id") is not None]) >= 4)
            answers = {e["id"]: outcome(e) for e in got if e.get("id") is not None}
            assert answers == {1: "subscribed", 2: "reply", 3: "too_many_calls", 4: "subscribed"}
            assert [e["id"] for e in got if e.get("id") is not None][:2] == [3, 4]  # at once
