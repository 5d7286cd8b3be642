"""Backend hooks on a node with the Redis broker (docs/integration.md, "Backend hooks"): the connect hook's
server-side `topics` are subscribed through the broker (attached from Redis, possibly after the register
returned), and messages published on another node reach them. A real backend (tests/gateway/test_proxy_hooks.py
`Backend`), two gateway processes, a real redis-server."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.cluster_helpers import collect
from tests.gateway.gw_helpers import send
from tests.gateway.hook_backend import Backend


@pytest.fixture
def backend():
    server = Backend()
    server.start()
    yield server
    server.stop()


def test_a_grants_server_side_topics_work_on_a_node_with_the_redis_broker(nodes, backend):
    backend.answers["connect"] = {"user": "olga", "topics": ["news.c", "news.d"], "info": {"n": 1}}
    a = nodes.start("a", proxy={"connect_url": backend.url("connect"), "timeout_s": 2.0})
    b = nodes.start("b")
    with a.ws() as ws:
        got = collect(ws, lambda g: len([e for e in g if e["type"] == "subscribed"]) >= 2)
        assert sorted((e["topic"], e["id"]) for e in got if e["type"] == "subscribed") == [("news.c", None), ("news.d", None)]
        assert not [e for e in got if e["type"] == "error"], got
        send(ws, op="rpc", method="whoami", id="who")
        got = collect(ws, lambda g: any(e.get("id") == "who" for e in g))
        assert next(e for e in got if e.get("id") == "who")["result"]["user"] == "olga"
        # published on B: through Redis to A's server-side subscription
        assert b.publish("news.c", {"from": "b"}).status_code in (200, 201, 202)
        got = collect(ws, lambda g: any(e["type"] == "msg" for e in g))
        assert [(e["topic"], e["data"]) for e in got if e["type"] == "msg"] == [("news.c", {"from": "b"})]
        # long-poll on A: the same grant, its topics in the first poll, and a message from B
        session = httpx.post(a.http_url + "/lp", timeout=5)
        assert session.status_code == 201, session.text
        sid = session.json()["session"]
        entries: list[dict] = []
        ack: list[int | None] = [None]

        def poll() -> None:
            params = {"ack": ack[0]} if ack[0] is not None else {}
            polled = httpx.get(f"{a.http_url}/lp/{sid}", params=params, timeout=10).json()
            ack[0] = polled["batch"] if polled["batch"] is not None else ack[0]
            entries.extend(polled["entries"])

        while len([e for e in entries if e["type"] == "subscribed"]) < 2:
            poll()
        assert sorted(e["topic"] for e in entries if e["type"] == "subscribed") == ["news.c", "news.d"]
        assert b.publish("news.d", 7).status_code in (200, 201, 202)
        while not [e for e in entries if e["type"] == "msg"]:
            poll()
        assert [(e["topic"], e["data"]) for e in entries if e["type"] == "msg"] == [("news.d", 7)]
    assert [c["transport"] for c in backend.received["connect"]] == ["ws", "longpoll"]
