"""Backend hooks over HTTP ([proxy], gateway/hooks/backend.py, docs/integration.md): a real backend (a Starlette app
served by uvicorn on loopback, recording what it receives, with switchable answers), a real gateway and real
clients."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.testing import make_token, run_gateway
from loadtest.ports import free_port
from tests import web
from tests.gateway.gw_helpers import auth, collect, recv_entries, send, wait_for, ws_connect
from tests.gateway.hook_backend import Backend
from tests.gateway.sse_client import SseClient

RULES = [
    {"pattern": "secret.*", "kind": "ring"},
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


def proxy_config(backend: Backend, **more: Any) -> dict[str, Any]:
    hooks = ("connect", "subscribe", "publish", "rpc", "refresh", "disconnect", "unsubscribe")
    return {
        **{f"{hook}_url": backend.url(hook) for hook in hooks},
        "timeout_s": 1.0,
        "forward_headers": ["Cookie", "Authorization"],
        **more,
    }


def closed_with(ws) -> tuple[int, str]:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=5)
    assert info.value.rcvd is not None, "the server sent no close frame"
    return info.value.rcvd.code, info.value.rcvd.reason


def info_of(gw, user: str) -> Any:
    client = gw.client_of(user)
    return gw.call(lambda: gw.hub.clients.conns[client].identity.info)


def test_a_grant_makes_the_connection_the_backends_user_with_its_topics_info_and_patterns(app):
    app.answers["connect"] = {
        "user": "alice",
        "subscribe": ["secret.*"],
        "topics": ["news.a"],
        "info": {"name": "Alice"},
        "expires_at": time.time() + 600,
    }
    with run_gateway(proxy=proxy_config(app), topics={"rules": RULES}) as gw:
        with connect(gw.ws_url, additional_headers={"Cookie": "sid=42", "X-Other": "no"}, open_timeout=5) as ws:
            # the server-side subscription arrives without a command
            assert collect(ws, lambda got: got)[0] | {"epoch": None} == {
                "type": "subscribed",
                "topic": "news.a",
                "kind": "ring",
                "epoch": None,
                "seq": 0,
                "id": None,
            }
            send(ws, op="subscribe", topic="secret.x", id=1)  # not anonymous: the granted pattern lets it
            assert recv_entries(ws)[0]["type"] == "subscribed"
            send(ws, op="rpc", method="whoami", id=2)
            assert recv_entries(ws)[0]["result"]["user"] == "alice"
            assert info_of(gw, "alice") == {"name": "Alice"}
        (call,) = app.received["connect"]
        assert call["headers"] == {"Cookie": "sid=42"}  # only forward_headers, only those sent
        assert call["transport"] == "ws" and call["address"] == "127.0.0.1" and call["user"] is None
        # long-poll: the same grant, the server-side topic in the first poll
        session = web.post(gw.http_url + "/lp", headers={"Cookie": "sid=7"}, timeout=5)
        assert session.status_code == 201
        polled = web.get(f"{gw.http_url}/lp/{session.json()['session']}", timeout=5).json()
        assert [(e["type"], e["topic"]) for e in polled["entries"]] == [("subscribed", "news.a")]
        assert app.received["connect"][1]["headers"] == {"Cookie": "sid=7"}
        app.received["connect"].pop()
        # a client with a token does not go through the hook (no connect_always); a token's `info` is kept
        token = make_token("bob", info={"plan": "pro"})
        with ws_connect(gw, query=f"?token={token}") as ws:
            send(ws, op="ping", id=1)
            recv_entries(ws)
            assert info_of(gw, "bob") == {"plan": "pro"}
        assert len(app.received["connect"]) == 1
        metrics = web.get(gw.http_url + "/metrics").text
        assert 'fanout_proxy_requests_total{hook="connect",outcome="ok"} 2.0' in metrics
        assert 'fanout_proxy_duration_seconds_count{hook="connect"} 2.0' in metrics


def test_a_refusal_is_4003_on_websocket_and_403_on_long_poll_and_sse(app):
    app.answers["connect"] = {"error": {"code": 1, "message": "who are you?"}}
    with run_gateway(proxy=proxy_config(app)) as gw:
        with connect(gw.ws_url, open_timeout=5) as ws:
            assert closed_with(ws) == (4003, "who are you?")
        r = web.post(gw.http_url + "/lp", timeout=5)
        assert r.status_code == 403 and r.json()["error"] == {"code": "forbidden", "message": "who are you?"}
        r = web.get(gw.http_url + "/sse?topics=a", timeout=5)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert [c["transport"] for c in app.received["connect"]] == ["ws", "longpoll", "sse"]
        assert gw.call(lambda: len(gw.hub.clients.conns)) == 0


def test_a_slow_backend_is_1013_and_503_and_connected_clients_stay(app):
    app.answers["connect"] = {"user": "carol"}
    with run_gateway(proxy=proxy_config(app, timeout_s=0.3)) as gw:
        with connect(gw.ws_url, open_timeout=5) as old:
            app.delays["connect"] = 1.5  # from now on the backend does not answer in time
            with connect(gw.ws_url, open_timeout=5) as ws:
                assert closed_with(ws)[0] == 1013
            r = web.post(gw.http_url + "/lp", timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
            assert r.headers["retry-after"] == "5"
            assert web.get(gw.http_url + "/sse", timeout=5).status_code == 503
            send(old, op="ping", id=7)
            assert recv_entries(old) == [{"type": "reply", "id": 7, "result": "pong"}]
        metrics = web.get(gw.http_url + "/metrics").text
        assert 'fanout_proxy_requests_total{hook="connect",outcome="timeout"} 3.0' in metrics


def test_a_backend_that_is_down_refuses_new_clients_and_commands_but_keeps_connections():
    down = f"http://127.0.0.1:{free_port()}"
    hooks = {f"{hook}_url": f"{down}/{hook}" for hook in ("connect", "subscribe", "rpc")}
    with run_gateway(proxy={**hooks, "timeout_s": 1.0}, topics={"rules": RULES}) as gw:
        with ws_connect(gw, query=f"?token={make_token('dave')}") as ws:  # a token: no connect hook
            with connect(gw.ws_url, open_timeout=5) as refused:
                code, reason = closed_with(refused)
                assert code == 1013 and reason.startswith("backend unavailable")
            send(ws, op="subscribe", topic="guarded.a", id=1)
            send(ws, op="rpc", method="custom", params={}, id=2)
            send(ws, op="subscribe", topic="plain", id=3)  # not proxied: answered at once
            entries = collect(ws, lambda got: len(got) >= 3)
            codes = {e["id"]: e.get("code", e["type"]) for e in entries}
            assert codes == {1: "backend_unavailable", 2: "backend_unavailable", 3: "subscribed"}


def test_subscribe_and_publish_hooks_allow_refuse_and_replace_the_data(app):
    app.answers["subscribe"] = lambda body: {"error": {"message": "not you"}} if body["topic"] == "guarded.no" else {}
    app.answers["publish"] = lambda body: {"data": {"wrapped": body["data"], "by": body["user"]}}
    with run_gateway(proxy=proxy_config(app, connect_url=""), topics={"rules": RULES}) as gw:
        with ws_connect(gw, query=f"?token={make_token('erin')}") as ws:
            send(ws, op="subscribe", topic="guarded.no", id=1)
            assert recv_entries(ws) == [{"type": "error", "code": "forbidden", "message": "not you", "id": 1}]
            send(ws, op="subscribe", topic="guarded.yes", id=2)
            assert recv_entries(ws)[0]["type"] == "subscribed"
            send(ws, op="publish", topic="guarded.yes", data=5, id=3)
            got = collect(ws, lambda got: any(e["type"] == "msg" for e in got))
            assert [e["data"] for e in got if e["type"] == "msg"] == [{"wrapped": 5, "by": "erin"}]
            send(ws, op="subscribe", topic="open.topic", id=4)  # a rule without proxy_subscribe: not asked
            assert recv_entries(ws)[0]["type"] == "subscribed"
        assert [c["topic"] for c in app.received["subscribe"]] == ["guarded.no", "guarded.yes"]
        (call,) = app.received["publish"]
        assert call == {"client": call["client"], "user": "erin", "transport": "ws", "topic": "guarded.yes", "data": 5}


def test_rpc_goes_to_the_backend_for_methods_the_gateway_does_not_know(app):
    app.answers["rpc"] = lambda body: (
        {"result": sum(body["params"])} if body["method"] == "sum" else {"error": {"code": "nope", "message": "no such thing"}}
    )
    with run_gateway(proxy=proxy_config(app, connect_url="")) as gw, ws_connect(gw) as ws:
        send(ws, op="rpc", method="sum", params=[1, 2, 3], id=1)
        assert recv_entries(ws) == [{"type": "reply", "id": 1, "result": 6}]
        send(ws, op="rpc", method="other", params=None, id=2)
        assert recv_entries(ws) == [{"type": "error", "code": "rpc_error", "message": "nope: no such thing", "id": 2}]
        send(ws, op="rpc", method="echo", params="x", id=3)  # built in: answered here
        assert recv_entries(ws) == [{"type": "reply", "id": 3, "result": "x"}]
        assert [(c["method"], c["params"], c["user"]) for c in app.received["rpc"]] == [
            ("sum", [1, 2, 3], None),
            ("other", None, None),
        ]


def test_refresh_extends_a_granted_expiry_and_a_refusal_closes_4011(app):
    app.answers["connect"] = {"user": "frank", "expires_at": time.time() + 1.0}
    app.answers["refresh"] = lambda body: {"expires_at": time.time() + 1.0}
    with run_gateway(proxy=proxy_config(app, refresh_before_s=0.6), limits={"idle_timeout_s": 0}) as gw:
        with connect(gw.ws_url, open_timeout=5) as ws:
            wait_for(lambda: len(app.received["refresh"]) >= 2, "two refreshes", timeout=5)
            send(ws, op="ping", id=1)  # still open past the first expiry
            assert recv_entries(ws)[0]["result"] == "pong"
            app.answers["refresh"] = {"error": {"message": "logged out"}}
            assert closed_with(ws) == (4011, "refresh refused: logged out")
        assert app.received["refresh"][0] == {"client": app.received["connect"][0]["client"], "user": "frank", "transport": "ws"}


def test_disconnect_and_unsubscribe_events_arrive_once_each_with_the_reason(app):
    with run_gateway(proxy=proxy_config(app, connect_url="")) as gw:
        with ws_connect(gw) as ws:
            send(ws, op="subscribe", topic="t.a", id=1)
            send(ws, op="unsubscribe", topic="t.a", id=2)
            collect(ws, lambda got: len(got) >= 2)
            first = gw.call(lambda: next(iter(gw.hub.clients.conns)))
        with ws_connect(gw) as kicked_ws:
            send(kicked_ws, op="subscribe", topic="t.b", id=1)
            recv_entries(kicked_ws)
            kicked = gw.call(lambda: next(iter(gw.hub.clients.conns)))
            assert httpx.delete(f"{gw.http_url}/api/clients/{kicked}", headers=auth(gw)).status_code == 200
            assert closed_with(kicked_ws)[0] == 4000
        session = web.post(gw.http_url + "/lp").json()
        httpx.delete(f"{gw.http_url}/lp/{session['session']}")
        wait_for(lambda: len(app.received["disconnect"]) >= 3, "three disconnect events")
        time.sleep(0.3)  # nothing more comes
        events = app.received["disconnect"]
        assert sorted((e["client"], e["reason"], e["transport"]) for e in events) == sorted(
            [(first, "closed", "ws"), (kicked, "kicked", "ws"), (session["client_id"], "closed", "longpoll")]
        )
        assert len({e["id"] for e in events}) == 3
        # an explicit unsubscribe only, not the subscription the kick ended
        assert [(e["client"], e["topic"]) for e in app.received["unsubscribe"]] == [(first, "t.a")]


def publish(gw, topic: str, data: Any) -> None:
    r = web.post(f"{gw.http_url}/api/topics/{topic}/publish", json={"data": data}, headers=auth(gw), timeout=5)
    assert r.status_code in (200, 201, 202), r.text


def test_sse_with_a_grant_opens_as_the_granted_user_and_its_server_side_topic_delivers(app):
    app.answers["connect"] = {"user": "gina", "subscribe": ["secret.*"], "topics": ["news.s"], "info": {"team": "red"}}
    with run_gateway(proxy=proxy_config(app), topics={"rules": RULES}) as gw:
        with SseClient(gw, "?topics=secret.x", headers={"Cookie": "sid=9"}) as sse:
            assert sse.status == 200
            client_id = sse.session()["client_id"]
            first = sse.collect(lambda got: len([e for e in got if e["type"] == "subscribed"]) >= 2)
            # the granted topic unasked (id null), the query's topic allowed by the granted pattern
            assert sorted((e["topic"], e.get("id")) for e in first if e["type"] == "subscribed") == [
                ("news.s", None),
                ("secret.x", None),
            ]
            assert not [e for e in first if e["type"] == "error"]
            publish(gw, "news.s", {"n": 1})
            got = sse.collect(lambda got: any(e["type"] == "msg" for e in got))
            assert [(e["topic"], e["data"]) for e in got if e["type"] == "msg"] == [("news.s", {"n": 1})]
            assert gw.client_of("gina") == client_id
            assert info_of(gw, "gina") == {"team": "red"}
        (call,) = app.received["connect"]
        assert (call["transport"], call["user"], call["headers"]) == ("sse", None, {"Cookie": "sid=9"})
        assert call["client"] == client_id


def test_connect_always_asks_about_a_client_with_a_token_too(app):
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        if body["user"] == "mallory":
            return {"error": {"message": "banned"}}
        return {"user": "", "topics": ["news.t"], "info": {"seen": True}}  # "": keep the token's identity

    app.answers["connect"] = answer
    with run_gateway(proxy=proxy_config(app, connect_always=True), topics={"rules": RULES}) as gw:
        token = make_token("henry", subscribe=["secret.*"], info={"plan": "free"})
        with ws_connect(gw, query=f"?token={token}") as ws:
            assert [(e["type"], e["topic"]) for e in collect(ws, lambda got: got)] == [("subscribed", "news.t")]
            send(ws, op="rpc", method="whoami", id=1)
            assert recv_entries(ws)[0]["result"]["user"] == "henry"
            send(ws, op="subscribe", topic="secret.h", id=2)  # the token's patterns still hold
            assert recv_entries(ws)[0]["type"] == "subscribed"
            assert info_of(gw, "henry") == {"seen": True}  # the backend's info replaces the token's
        with ws_connect(gw, query=f"?token={make_token('mallory')}") as ws:
            assert closed_with(ws) == (4003, "banned")
        r = web.post(gw.http_url + "/lp", headers={"Authorization": f"Bearer {make_token('mallory')}"}, timeout=5)
        assert r.status_code == 403 and r.json()["error"] == {"code": "forbidden", "message": "banned"}
        with ws_connect(gw) as anonymous:  # and a client without a token, as always
            assert [e["topic"] for e in collect(anonymous, lambda got: got)] == ["news.t"]
        assert [(c["user"], c["transport"]) for c in app.received["connect"]] == [
            ("henry", "ws"),
            ("mallory", "ws"),
            ("mallory", "longpoll"),
            (None, "ws"),
        ]
        calls = app.received["connect"]
        # a bad token is refused before any call
        before = len(calls)
        with connect(gw.ws_url + "?token=not.a.token", open_timeout=5) as ws:
            assert closed_with(ws)[0] == 4001
        assert len(app.received["connect"]) == before


def test_connect_always_keeps_the_tokens_jti_so_revoking_the_token_closes_the_connection(app):
    app.answers["connect"] = lambda body: {"user": body["user"], "subscribe": ["secret.*"]}  # the same user
    with run_gateway(proxy=proxy_config(app, connect_always=True), topics={"rules": RULES}) as gw:
        with ws_connect(gw, query=f"?token={make_token('judy', jti='t-1')}") as ws:
            send(ws, op="subscribe", topic="secret.j", id=1)  # the grant's pattern
            assert recv_entries(ws)[0]["type"] == "subscribed"
            r = web.post(f"{gw.http_url}/api/revocations", json={"jti": "t-1"}, headers=auth(gw), timeout=5)
            assert r.status_code == 201 and r.json()["disconnected"] == 1, r.text
            assert closed_with(ws)[0] == 4010
