"""Admin REST API, /metrics, /healthz, static files."""

import pytest

import core
from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gw():
    """A gateway of the defaults for the tests that neither change a setting nor count the clients."""
    with run_gateway() as handle:
        yield handle


def test_refuses_without_the_token(gw):
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
            r = http.get("/api/topics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_topics_crud_and_publish_reach_websocket_clients(gw):
    with web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        r = http.post("/api/topics", json={"name": "scores", "kind": "snapshot"})
        assert r.status_code == 201 and r.json()["kind"] == "snapshot"
        assert http.post("/api/topics", json={"name": "scores"}).status_code == 409
        assert http.post("/api/topics", json={"name": "x", "kind": "weird"}).status_code == 400
        assert http.post("/api/topics/scores/publish", json={"messages": [{"s": 1}, {"s": 2}]}).json()["seqs"] == [0, 1]
        with ws_connect(gw) as ws:
            send(ws, op="subscribe", topic="scores")
            got = collect(ws, lambda g: any(e["type"] == "msg" for e in g))
            assert [e["data"] for e in got if e["type"] == "msg"] == [{"s": 2}]  # state of the world
            assert http.get("/api/topics/scores").json()["subscribers"] == 1
            assert http.delete("/api/topics/scores").json()["subscribers_notified"] == 1
            assert recv_entries(ws) == [{"type": "closed", "topic": "scores", "reason": "deleted"}]
        assert http.get("/api/topics/scores").status_code == 404
        assert http.post("/api/topics/nope.nope/publish", json={"data": 1}).status_code in (200, 404)


def test_private_publish_waits_for_space_then_503():
    with (
        run_gateway(
            admin={"publish_timeout_s": 0.5}, topics={"rules": [{"pattern": "*", "kind": "private", "max_count": 2}]}
        ) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={make_token('bob')}") as ws,
    ):
        send(ws, op="subscribe", topic="inbox")
        recv_entries(ws)
        bob = gw.client_of("bob")
        gw.call(lambda: gw.hub.scheduler.engine.mark_idle(bob))  # bob is not reading: his queue fills
        r = http.post("/api/topics/inbox/publish", json={"messages": [1, 2], "client": "bob"})
        assert r.json()["seqs"] == [0, 1]
        r = http.post("/api/topics/inbox/publish", json={"data": 3, "client": "bob"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"


def test_list_and_kick_clients():
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={make_token('carol')}") as ws,
    ):
        send(ws, op="subscribe", topic="t")
        recv_entries(ws)
        clients = http.get("/api/clients").json()["clients"]
        carol = gw.client_of("carol")
        assert [(c["id"], c["user"]) for c in clients] == [(carol, "carol")] and clients[0]["subscriptions"] == ["t"]
        assert http.delete(f"/api/clients/{carol}").json() == {"kicked": carol}
        with pytest.raises(Exception) as info:
            ws.recv(timeout=5)
        assert "4000" in str(info.value)
        assert http.delete(f"/api/clients/{carol}").status_code == 404


def test_stats_metrics_health_openapi_static(gw):
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        metrics = http.get("/metrics").text
        for name in (
            "fanout_messages_published_total",
            "fanout_cycle_duration_seconds_bucket",
            "fanout_entries_per_batch_bucket",
            "fanout_write_blocked_clients",
            "fanout_clients",
        ):
            assert name in metrics
        assert f"\nfanout_core_compiled {float(core.COMPILED)}\n" in metrics  # which build of the core runs
        spec = http.get("/api/openapi.json").json()
        assert spec["openapi"].startswith("3.") and "/api/topics/{name}/publish" in spec["paths"]
        assert "core" in http.get("/api/stats", headers=auth(gw)).json()
        assert "<title>fanout-gateway</title>" in http.get("/").text
        r = http.get("/no/such/thing")
        assert r.status_code == 404


def test_malformed_admin_requests_get_json_errors(gw):
    with web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        for path, body, status, code in [
            ("/api/topics", b"{nope", 400, "bad_json"),
            ("/api/topics", b"[]", 400, "bad_request"),
            ("/api/topics/t/publish", b'{"data": 1, "messages": [2]}', 400, "bad_request"),
            ("/api/topics/t/publish", b'{"messages": 5}', 400, "bad_request"),
            ("/api/topics/t/publish", b'{"data": 1, "seq": "x"}', 400, "bad_request"),
        ]:
            r = http.post(path, content=body)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), path
        assert http.post("/api/topics/t/publish", json={"data": 1, "seq": 0}).json()["seqs"] == [0]
        r = http.post("/api/topics/t/publish", json={"data": 1, "seq": 0})  # a retry: already there
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_seq"
