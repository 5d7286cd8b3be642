"""User control on one node (docs/integration.md, "User control"): disconnect a user (4005), revoke tokens by `jti` or
by user and `issued_before` (refused at connect and by `auth`, holders closed with 4010, entries expire),
and `limits.max_connections_per_user` (the oldest gives way, 4013). Real gateway, real clients."""

from __future__ import annotations

import itertools
import time

import pytest
from websockets.exceptions import ConnectionClosed

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, wait_for, ws_connect


def close_of(ws) -> int:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=5)
    assert info.value.rcvd is not None, "the server sent no close frame"
    return info.value.rcvd.code


_topics = itertools.count()


def alive(ws) -> bool:
    """Whether the connection still answers (a subscribe to a new topic)."""
    topic = f"t{next(_topics)}"
    send(ws, op="subscribe", topic=topic, id=topic)
    got = collect(ws, lambda es: any(e.get("id") == topic for e in es))
    return any(e["type"] == "subscribed" for e in got)


def test_disconnect_user_closes_all_its_connections_with_4005_and_no_other():
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw, query=f"?token={make_token('alice')}") as a1,
        ws_connect(gw, query=f"?token={make_token('alice')}") as a2,
        ws_connect(gw, query=f"?token={make_token('bob')}") as b,
    ):
        lp = web.post(f"{gw.http_url}/lp", headers={"Authorization": f"Bearer {make_token('alice')}"}).json()
        r = http.delete("/api/users/alice")
        assert r.status_code == 200 and r.json() == {"user": "alice", "disconnected": 3, "nodes": 1}
        assert close_of(a1) == close_of(a2) == 4005
        entries = web.get(f"{gw.http_url}/lp/{lp['session']}", timeout=10).json()["entries"]
        assert [(e["code"], e["close_code"]) for e in entries] == [("closed", 4005)]
        assert alive(b)
        assert http.delete("/api/users/alice").json()["disconnected"] == 0


def test_revocations_refuse_at_connect_close_holders_and_expire():
    config = {"auth": {"leeway_s": 0.0, "revocation_ttl_s": 3.0, "max_revocations": 2}}
    with run_gateway(**config) as gw, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        one, two = make_token("dave", jti="j1"), make_token("dave", jti="j2")
        with ws_connect(gw, query=f"?token={one}") as w1, ws_connect(gw, query=f"?token={two}") as w2:
            r = http.post("/api/revocations", json={"jti": "j1", "expires_at": time.time() + 1.5})
            assert r.status_code == 201 and r.json()["disconnected"] == 1, r.text
            assert close_of(w1) == 4010
            assert alive(w2)  # another token of the same user
        with ws_connect(gw, query=f"?token={one}") as again:
            assert close_of(again) == 4010
        with ws_connect(gw) as anonymous:  # the `auth` command checks the same table
            send(anonymous, op="auth", token=one, id="a")
            error = collect(anonymous, lambda es: any(e.get("id") == "a" for e in es))[-1]
            assert (error["type"], error["code"]) == ("error", "token_revoked")
        r = web.post(f"{gw.http_url}/lp", headers={"Authorization": f"Bearer {one}"})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "token_revoked")

        # by user: tokens issued before the time are revoked, later ones are not
        old = make_token("erin", iat=int(time.time()) - 10)
        with ws_connect(gw, query=f"?token={old}") as holder:
            issued_before = time.time() - 1
            r = http.post("/api/revocations", json={"user": "erin", "issued_before": issued_before})
            assert r.status_code == 201 and r.json()["disconnected"] == 1, r.text
            assert close_of(holder) == 4010
        with ws_connect(gw, query=f"?token={old}") as again:
            assert close_of(again) == 4010
        with ws_connect(gw, query=f"?token={make_token('erin', iat=int(time.time()))}") as fresh:
            assert alive(fresh)
        assert http.post("/api/revocations", json={"user": "erin", "jti": "x"}).status_code == 400
        r = http.post("/api/revocations", json={"jti": "j3"})  # auth.max_revocations live entries: refused
        assert (r.status_code, r.json()["error"]["code"]) == (507, "too_many_revocations")

        # both expire: the jti one with the `expires_at` given, the user's revocation_ttl_s after issued_before
        def accepted(token: str) -> bool:
            with ws_connect(gw, query=f"?token={token}") as ws:
                try:
                    return alive(ws)
                except ConnectionClosed:
                    return False

        wait_for(lambda: accepted(one), "the jti revocation to expire", timeout=5)
        wait_for(lambda: accepted(old), "the user revocation to expire", timeout=5)
        assert http.post("/api/revocations", json={"jti": "j3"}).status_code == 201  # room again


def test_per_user_limit_the_oldest_gives_way_with_4013():
    with (
        run_gateway(limits={"max_connections_per_user": 2}) as gw,
        ws_connect(gw, query=f"?token={make_token('frank')}") as f1,
        ws_connect(gw, query=f"?token={make_token('frank')}") as f2,
        ws_connect(gw) as anon1,
        ws_connect(gw) as anon2,
        ws_connect(gw) as anon3,
    ):
        assert alive(f1) and alive(f2)
        with ws_connect(gw, query=f"?token={make_token('frank')}") as f3:
            assert close_of(f1) == 4013
            assert alive(f2) and alive(f3)
            send(anon1, op="auth", token=make_token("frank"), id="a")  # becoming frank's counts too
            collect(anon1, lambda es: any(e.get("id") == "a" for e in es))
            assert close_of(f2) == 4013
            assert alive(f3) and alive(anon1) and alive(anon2) and alive(anon3)  # anonymous: not counted
