"""`gateway token` mints what revocation needs (docs/integration.md, "User control"): an `iat`, so "revoke the
user, then hand out a fresh token" lets the user back in, and a `jti`, so one token can be revoked alone.
Tokens minted by the command itself, revocations through the admin API of a real gateway."""

from __future__ import annotations

import time

import jwt
import pytest
from websockets.exceptions import ConnectionClosed

from gateway import cli
from gateway.testing import TEST_JWT_SECRET, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, ws_connect


@pytest.fixture
def mint(monkeypatch, capsys):
    """`gateway token --sub USER` as an operator runs it, with the test gateway's secret in the environment."""
    monkeypatch.setenv("GATEWAY_AUTH_JWT_SECRET", TEST_JWT_SECRET)

    def run(user: str) -> str:
        capsys.readouterr()
        assert cli.main(["token", "--sub", user]) == 0
        return capsys.readouterr().out.strip()

    return run


def close_of(ws) -> int:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=5)
    assert info.value.rcvd is not None, "the server sent no close frame"
    return info.value.rcvd.code


def alive(ws, topic: str) -> bool:
    send(ws, op="subscribe", topic=topic, id=topic)
    got = collect(ws, lambda es: any(e.get("id") == topic for e in es))
    return any(e["type"] == "subscribed" for e in got)


def test_minted_tokens_carry_iat_and_a_distinct_jti(mint) -> None:
    before = time.time()
    one, two = (jwt.decode(mint("zoe"), TEST_JWT_SECRET, algorithms=["HS256"]) for _ in range(2))
    assert before - 1 <= one["iat"] <= time.time()
    assert isinstance(one["jti"], str) and len(one["jti"]) >= 16 and one["jti"] != two["jti"]


def test_a_fresh_token_after_a_user_revocation_connects_and_a_jti_revokes_one_token(mint) -> None:
    with run_gateway() as gw, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        with ws_connect(gw, query=f"?token={mint('zoe')}") as holder:
            r = http.post("/api/revocations", json={"user": "zoe"})  # "log out everywhere": T = now
            assert r.status_code == 201 and r.json()["disconnected"] == 1, r.text
            assert close_of(holder) == 4010
        # T was taken before the answer came; `iat` is to the millisecond: a token minted 5 ms on is after T
        time.sleep(0.005)
        with ws_connect(gw, query=f"?token={mint('zoe')}") as fresh:
            assert alive(fresh, "t1")

        first, second = mint("zoe"), mint("zoe")
        with ws_connect(gw, query=f"?token={first}") as w1, ws_connect(gw, query=f"?token={second}") as w2:
            jti = jwt.decode(first, TEST_JWT_SECRET, algorithms=["HS256"])["jti"]
            r = http.post("/api/revocations", json={"jti": jti})
            assert r.status_code == 201 and r.json()["disconnected"] == 1, r.text
            assert close_of(w1) == 4010
            assert alive(w2, "t2")
