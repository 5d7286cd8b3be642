"""Subscriber identity with JWTs: every token path, per-topic permissions, expiry and refresh (issue 8)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from websockets.exceptions import ConnectionClosed

from gateway.testing import TEST_JWT_SECRET, make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, collect, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)

#: a rule set where news.* needs a token, everything else is open
RULES = {
    "rules": [
        {"pattern": "private.*", "kind": "private"},
        {"pattern": "news.*", "kind": "ring", "client_publish": True},
        {"pattern": "*", "kind": "ring", "client_publish": True, "anonymous": True},
    ]
}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def close_code(ws) -> int:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=5)
    assert info.value.rcvd is not None, "the server sent no close frame"
    return info.value.rcvd.code


def reply(ws, **command) -> dict:
    send(ws, **command)
    return recv_entries(ws)[0]


@pytest.fixture(scope="module")
def ruled():
    """One gateway with RULES for the tests that need nothing else (each its own topics and users)."""
    with run_gateway(topics=RULES) as gw:
        yield gw


def test_a_valid_token_names_the_user_and_its_patterns_allow_and_deny(ruled):
    token = make_token("ann", subscribe=["news.sport.*"], publish=["news.sport.live"])
    with ws_connect(ruled, query=f"?token={token}") as ws:
        who = reply(ws, op="rpc", method="whoami", id=1)["result"]
        assert who["user"] == "ann" and who["client_id"].startswith("ws-")
        assert reply(ws, op="subscribe", topic="news.sport.tennis", id=2)["type"] == "subscribed"
        denied = reply(ws, op="subscribe", topic="news.politics", id=3)
        assert (denied["type"], denied["code"], denied["id"]) == ("error", "forbidden", 3)
        assert reply(ws, op="publish", topic="news.sport.live", data=1, id=4)["type"] == "reply"
        assert reply(ws, op="publish", topic="news.sport.tennis", data=1, id=5)["code"] == "forbidden"
        assert reply(ws, op="subscribe", topic="open.topic", id=6)["type"] == "subscribed"  # anonymous topics too


def test_anonymous_clients_reach_only_anonymous_topics_and_see_only_those(ruled):
    gw = ruled
    with ws_connect(gw) as ws:
        gw.call(lambda: [gw.hub.scheduler.engine.resolve(n) for n in ("news.secret", "private.inbox", "open.a")])
        assert reply(ws, op="subscribe", topic="news.secret", id=1)["code"] == "forbidden"
        assert reply(ws, op="subscribe", topic="private.inbox", id=2)["code"] == "forbidden"
        assert reply(ws, op="publish", topic="news.secret", data=1, id=3)["code"] == "forbidden"
        listed = [t["name"] for t in reply(ws, op="rpc", method="topics", id=4)["result"]]
        # the gateway is shared: other tests' open topics may be listed too, never one of news.* / private.*
        assert "open.a" in listed and not [n for n in listed if n.startswith(("news.", "private."))], listed
        assert reply(ws, op="rpc", method="whoami", id=5)["result"]["user"] is None


#: tokens made when the test runs, not when it is collected: a suite longer than a token's life would see
#: `expired` instead of the refusal each case is about
@pytest.mark.parametrize(
    "make, code, words",
    [
        (lambda: make_token("eve", secret="not-the-gateway-secret-but-32-bytes!!"), 4001, "signature"),
        (lambda: jwt.encode({"exp": int(time.time()) + 60}, TEST_JWT_SECRET, algorithm="HS256"), 4001, "sub"),
        (lambda: jwt.encode({"sub": "eve"}, TEST_JWT_SECRET, algorithm="HS256"), 4001, "exp"),
        (lambda: make_token("eve", subscribe="news.*"), 4001, "subscribe"),
        (lambda: make_token("eve", ttl=-60), 4011, "expired"),
        (lambda: jwt.encode({"sub": "eve", "exp": int(time.time()) + 60}, None, algorithm="none"), 4001, "algorithm"),  # type: ignore[arg-type]
        (lambda: "not-a-jwt", 4001, "invalid"),
    ],
    ids=["signature", "sub", "exp", "subscribe", "expired", "algorithm", "invalid"],
)
def test_refused_tokens_close_the_handshake_with_a_code_and_reason(ruled, make, code, words):
    with ws_connect(ruled, query=f"?token={make()}") as ws:
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=5)
        assert info.value.rcvd.code == code and words in info.value.rcvd.reason.lower()


def test_audience_and_issuer_are_checked_when_configured():
    auth = {"jwt_audience": "fanout", "jwt_issuer": "https://issuer.example"}
    good = make_token("ann", aud="fanout", iss="https://issuer.example")
    with run_gateway(auth=auth) as gw:
        with ws_connect(gw, query=f"?token={good}") as ws:
            assert reply(ws, op="ping", id=1)["result"] == "pong"
        for bad in (make_token("ann", aud="other", iss="https://issuer.example"), make_token("ann", aud="fanout")):
            with ws_connect(gw, query=f"?token={bad}") as ws:
                assert close_code(ws) == 4001


def test_es256_tokens_are_checked_with_the_public_key_and_never_as_an_hmac_secret(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "key.pem").write_bytes(public_pem)
    claims = {"sub": "ann", "exp": int(time.time()) + 60}
    with run_gateway(auth={"jwt_secret": "", "jwt_public_key_file": str(tmp_path / "key.pem")}) as gw:
        with ws_connect(gw, query=f"?token={jwt.encode(claims, key, algorithm='ES256')}") as ws:
            assert reply(ws, op="rpc", method="whoami", id=1)["result"]["user"] == "ann"
        # algorithm confusion: the public key used as an HS256 secret must not verify
        signing = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(claims).encode())
        forged = signing + "." + b64(hmac.new(public_pem, signing.encode(), hashlib.sha256).digest())
        with ws_connect(gw, query=f"?token={forged}") as ws:
            assert close_code(ws) == 4001


def test_an_expired_token_gets_a_notice_then_the_close_unless_refreshed():
    limits = {"auth": {"leeway_s": 0, "expired_grace_s": 1.0}}

    def expired(got: list[dict]) -> bool:
        return any(e.get("code") == "token_expired" for e in got)

    # two connections whose tokens expire together: one is left to its close, the other refreshes in time.
    # A fractional `exp` (JWT allows it): 2 s after the start, not make_token's whole seconds (2 to 3 s)
    with run_gateway(**limits) as gw:
        expiring = jwt.encode({"sub": "ann", "exp": time.time() + 2.0}, TEST_JWT_SECRET, algorithm="HS256")
        with ws_connect(gw, query=f"?token={expiring}") as ws, ws_connect(gw, query=f"?token={expiring}") as kept:
            send(ws, op="subscribe", topic="chat.a")
            got = collect(ws, expired, timeout=8)
            assert got[-1]["type"] == "error"
            collect(kept, expired, timeout=8)
            refreshed = reply(kept, op="auth", token=make_token("ann", ttl=60), id=7)
            assert refreshed["type"] == "reply" and refreshed["result"]["user"] == "ann"
            assert close_code(ws) == 4011  # the same token's grace is over for `kept` too
            time.sleep(0.3)  # past it (with a margin): still open
            assert reply(kept, op="ping", id=8)["result"] == "pong"
            other = reply(kept, op="auth", token=make_token("mallory"), id=9)
            assert (other["type"], other["code"]) == ("error", "bad_token")


def test_an_anonymous_connection_authenticates_with_a_first_auth_command(ruled):
    gw = ruled
    with ws_connect(gw) as ws:
        assert reply(ws, op="subscribe", topic="private.inbox", id=1)["code"] == "forbidden"
        bad = reply(ws, op="auth", token=make_token("ann", ttl=-60), id=2)
        assert bad["code"] == "token_expired"
        assert reply(ws, op="auth", token=make_token("ann"), id=3)["result"]["user"] == "ann"
        assert reply(ws, op="subscribe", topic="private.inbox", id=4)["type"] == "subscribed"
        pub = Ingest(gw)
        pub.send({"topic": "private.inbox", "client": "ann", "data": "hello ann"})
        assert pub.sync()["accepted"] == 1
        got = collect(ws, lambda g: any(e["type"] == "msg" for e in g))
        assert [e["data"] for e in got if e["type"] == "msg"] == ["hello ann"]


def test_long_poll_takes_a_bearer_token_and_refuses_bad_ones(ruled):
    with web.Client(base_url=ruled.http_url, timeout=10) as http:
        r = http.post("/lp", headers={"Authorization": f"Bearer {make_token('ann', subscribe=['news.*'])}"})
        assert r.status_code == 201
        session = r.json()["session"]
        http.post(f"/lp/{session}", json={"op": "subscribe", "topic": "news.a", "id": 1})
        assert http.get(f"/lp/{session}").json()["entries"][0]["type"] == "subscribed"
        for header, code in (
            (f"Bearer {make_token('ann', ttl=-60)}", "token_expired"),
            ("Bearer junk", "bad_token"),
            ("Basic YTpi", "bad_token"),
        ):
            r = http.post("/lp", headers={"Authorization": header})
            assert r.status_code == 401 and r.json()["error"]["code"] == code


def test_authentication_not_configured_refuses_tokens_but_serves_anonymous_clients():
    with run_gateway(auth={"jwt_secret": ""}) as gw:
        with ws_connect(gw, query=f"?token={make_token('ann')}") as ws:
            assert close_code(ws) == 4001
        with ws_connect(gw) as ws:
            assert reply(ws, op="subscribe", topic="chat.a", id=1)["type"] == "subscribed"
