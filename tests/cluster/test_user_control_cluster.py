"""User control across the cluster (docs/integration.md, "User control"): two gateway processes on a real Redis. An
operator on node A lists node B's clients, kicks one of them, disconnects a user on both nodes, and revokes
a token held on B; a node started later refuses the revoked token too (it rereads the revocations)."""

from __future__ import annotations

import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.testing import TEST_JWT_SECRET, make_token
from tests.cluster.cluster_helpers import TOKEN
from tests.gateway.gw_helpers import send

AUTH = {"jwt_secret": TEST_JWT_SECRET, "leeway_s": 0.0}
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
#: the documented bound: a command reaches every connected node within a Redis round trip, the API answers
#: within control.CONTROL_REPLY_TIMEOUT_S (2 s); here a generous margin on a busy machine
BOUND_S = 2.0


def ws_as(node, token: str | None):
    return connect(node.ws_url + (f"?token={token}" if token else ""), open_timeout=5, compression=None)


def close_of(ws, timeout: float = 5.0) -> tuple[int, float]:
    """The close code the connection gets, and how long it took to come."""
    started = time.monotonic()
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=timeout)
    assert info.value.rcvd is not None, "the server sent no close frame"
    return info.value.rcvd.code, time.monotonic() - started


def test_kick_disconnect_revoke_and_list_reach_the_other_node(nodes):
    a, b = nodes.start("a", auth=AUTH), nodes.start("b", auth=AUTH)
    api = httpx.Client(base_url=a.http_url, headers=ADMIN, timeout=10)
    with (
        ws_as(a, make_token("gina")) as gina_a,
        ws_as(b, make_token("gina")) as gina_b,
        ws_as(b, make_token("hal")) as hal,
        ws_as(b, make_token("ivy", jti="k1")) as ivy,
    ):
        listed = api.get("/api/clients").json()
        assert listed["nodes"] == 2 and listed["total"] == 4 and not listed["truncated"]
        by_user = {(c["user"], c["node"]) for c in listed["clients"]}
        node_b = next(n for u, n in by_user if u == "hal")
        node_a = next(n for _, n in by_user if n != node_b)
        assert by_user == {("gina", node_a), ("gina", node_b), ("hal", node_b), ("ivy", node_b)}

        hal_id = next(c["id"] for c in listed["clients"] if c["user"] == "hal")
        assert api.delete(f"/api/clients/{hal_id}").json() == {"kicked": hal_id}  # held by B, asked of A
        assert close_of(hal)[0] == 4000
        assert api.delete("/api/clients/ws-0000000000000000").status_code == 404

        assert api.delete("/api/users/gina").json() == {"user": "gina", "disconnected": 2, "nodes": 2}
        for ws in (gina_a, gina_b):
            code, took = close_of(ws)
            assert code == 4005 and took < BOUND_S

        r = api.post("/api/revocations", json={"jti": "k1"})
        assert r.status_code == 201 and r.json()["disconnected"] == 1 and r.json()["nodes"] == 2, r.text
        code, took = close_of(ivy)
        assert code == 4010 and took < BOUND_S
    with ws_as(b, make_token("ivy", jti="k1")) as again:
        assert close_of(again)[0] == 4010
    c = nodes.start("c", auth=AUTH)  # after the revocation: reads it from Redis at start
    with ws_as(c, make_token("ivy", jti="k1")) as late:
        assert close_of(late)[0] == 4010
    with ws_as(c, make_token("ivy", jti="k2")) as other:  # another token of the user is fine
        send(other, op="subscribe", topic="t", id="s")
        assert '"subscribed"' in other.recv(timeout=5)
    assert api.get("/api/clients").json()["nodes"] == 3
    api.close()
