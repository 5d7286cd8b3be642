"""Token keys from a JWKS endpoint (`auth.jwks_url`, gateway/auth/jwks.py; docs/security.md, "JWKS"), against a
real key-set server on loopback that rotates its keys mid-test and counts the requests it gets.

The design under test: verification stays synchronous and never waits on the network; a token naming a `kid`
the set lacks is refused now as a passing state (`keys_refreshing`: close 1013, HTTP 503) and the set is
fetched again in the background, at most once per `auth.jwks_refresh_min_s`; a `kid` a later set still lacks
is `bad_token` (4001); the last good set survives a failing endpoint; nothing of a token's header (`jku`,
`x5u`) is ever fetched."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm
from websockets.exceptions import ConnectionClosed

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import collect, send, wait_for, ws_connect

pytestmark = pytest.mark.timeout(90)


class KeySetServer:
    """A JWKS endpoint on 127.0.0.1: `publish(...)` replaces its keys, `status` / `cache_control` shape its
    answer, `requests` counts what it served (with the time of each)."""

    def __init__(self) -> None:
        self.keys: list[dict] = []
        self.status = 200
        self.cache_control: str | None = "max-age=300"
        self.requests: list[float] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.requests.append(time.monotonic())
                body = json.dumps({"keys": owner.keys}).encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                if owner.cache_control:
                    self.send_header("Cache-Control", owner.cache_control)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/certs"

    def publish(self, *keys: tuple[str, object]) -> None:
        self.keys = [_jwk(kid, private) for kid, private in keys]


def _jwk(kid: str, private: object) -> dict:
    public = private.public_key()  # type: ignore[attr-defined]
    if isinstance(public, rsa.RSAPublicKey):
        jwk, alg = RSAAlgorithm.to_jwk(public, as_dict=True), "RS256"
    elif isinstance(public, ec.EllipticCurvePublicKey):
        jwk, alg = ECAlgorithm.to_jwk(public, as_dict=True), "ES256"
    else:
        jwk, alg = OKPAlgorithm.to_jwk(public, as_dict=True), "EdDSA"
    return {**jwk, "kid": kid, "use": "sig", "alg": alg}


def _token(private: Any, alg: str, kid: str | None, sub: str = "u1", **headers: str) -> str:
    header = {"kid": kid, **headers} if kid is not None else headers
    return jwt.encode({"sub": sub, "exp": int(time.time()) + 600}, private, algorithm=alg, headers=header)


@pytest.fixture
def keyset() -> Iterator[KeySetServer]:
    server = KeySetServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture(scope="module")
def keys() -> dict[str, object]:
    return {
        "rsa": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ec": ec.generate_private_key(ec.SECP256R1()),
        "ed": ed25519.Ed25519PrivateKey.generate(),
        "rsa2": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ec_attacker": ec.generate_private_key(ec.SECP256R1()),
    }


def _gateway(keyset: KeySetServer, **auth: object):
    return run_gateway(
        auth={
            "jwt_secret": "",
            "jwks_url": keyset.url,
            "jwks_refresh_min_s": 1.0,
            "rate_per_ip": 0.0,
            "rate_per_connection": 0.0,
            **auth,
        }
    )


def _auth(ws, token: str, request_id: int) -> dict:
    send(ws, op="auth", token=token, id=request_id)
    return collect(ws, lambda got: any(e.get("id") == request_id for e in got))[-1]


def test_a_key_published_after_the_start_is_accepted_on_retry_and_every_algorithm_checks(keyset, keys):
    keyset.publish(("k-rsa", keys["rsa"]), ("k-ec", keys["ec"]), ("k-ed", keys["ed"]))
    with _gateway(keyset) as gw, ws_connect(gw) as ws:
        assert len(keyset.requests) == 1  # loaded at start
        for request_id, (kid, key, alg) in enumerate(
            [("k-rsa", "rsa", "RS256"), ("k-ec", "ec", "ES256"), ("k-ed", "ed", "EdDSA")]
        ):
            answer = _auth(ws, _token(keys[key], alg, kid), request_id)
            assert answer["type"] == "reply" and answer["result"]["user"] == "u1", answer
        # a token's alg must be its key's: the RSA key's kid on an ES256 token is refused
        answer = _auth(ws, _token(keys["ec"], "ES256", "k-rsa"), 10)
        assert answer["code"] == "bad_token" and "not the algorithm of its key" in answer["message"], answer
        # the provider rotates: a new key appears; the first token naming it is refused: try again later...
        keyset.publish(("k-rsa", keys["rsa"]), ("k-new", keys["rsa2"]))
        rotated = _token(keys["rsa2"], "RS256", "k-new")
        first = _auth(ws, rotated, 11)
        assert first["code"] == "keys_refreshing" and first["message"].endswith("retry later"), first
        # ... and a retry soon after is accepted (the set was fetched again in the background)
        replies = iter(range(12, 200))
        wait_for(lambda: _auth(ws, rotated, next(replies))["type"] == "reply", "the rotated key", timeout=10)
        with web.Client(base_url=gw.http_url, timeout=10) as http:  # the handshake checks it too
            assert http.post("/lp", headers={"Authorization": f"Bearer {rotated}"}).status_code == 201
        # the retired key is gone from the set: its tokens are refused now, as passing until a set fetched
        # after the first refusal lacks it too, then for good
        gone = _token(keys["ec"], "ES256", "k-ec")
        assert _auth(ws, gone, 300)["code"] == "keys_refreshing"
        refusals = iter(range(301, 400))
        wait_for(lambda: _auth(ws, gone, next(refusals))["code"] == "bad_token", "a final refusal", timeout=10)


def test_a_thousand_random_kids_cause_at_most_one_fetch_per_refresh_min_s(keyset, keys):
    keyset.publish(("k-ec", keys["ec"]))
    refresh_min_s = 1.0  # the least allowed: the flood still spans several refresh windows' worth of asks
    with _gateway(keyset, jwks_refresh_min_s=refresh_min_s) as gw, ws_connect(gw) as ws:
        before = len(keyset.requests)
        started = time.monotonic()
        for frame in range(10):  # 1,000 auth commands, 100 per frame, each naming a kid of its own
            ws.send(
                "["
                + ",".join(
                    json.dumps(
                        {"op": "auth", "id": frame * 100 + i, "token": _token(keys["ec_attacker"], "ES256", secrets.token_hex(8))}
                    )
                    for i in range(100)
                )
                + "]"
            )
        got = collect(ws, lambda got: sum(e.get("type") == "error" for e in got) >= 1000, timeout=30)
        time.sleep(refresh_min_s + 0.5)  # a refetch asked for during the flood happens within this
        elapsed = time.monotonic() - started
        fetches = len(keyset.requests) - before
        assert all(e["code"] == "keys_refreshing" for e in got if e.get("type") == "error")
        assert 1 <= fetches <= elapsed // refresh_min_s + 1, (fetches, elapsed)
        print(
            f"\n1,000 unknown kids in {elapsed:.1f} s: {fetches} fetches of the key set (jwks_refresh_min_s = {refresh_min_s:g})"
        )
        metrics = web.get(f"{gw.http_url}/metrics", timeout=10).text
        assert "fanout_auth_jwks_unknown_kid_total 1000.0" in metrics
        # the real key still works
        assert _auth(ws, _token(keys["ec"], "ES256", "k-ec"), 5000)["type"] == "reply"


def test_the_last_good_set_is_kept_when_the_endpoint_fails(keyset, keys):
    keyset.publish(("k-ec", keys["ec"]))
    with _gateway(keyset) as gw, ws_connect(gw) as ws:
        keyset.status = 500  # the provider breaks; an unknown kid makes the gateway try it
        before = len(keyset.requests)
        assert _auth(ws, _token(keys["rsa"], "RS256", "k-unknown"), 1)["code"] == "keys_refreshing"
        wait_for(lambda: len(keyset.requests) > before, "a refetch")

        def failed_once() -> str | None:
            metrics = web.get(f"{gw.http_url}/metrics", timeout=10).text
            return metrics if 'fanout_auth_jwks_fetches_total{result="failed"} 1.0' in metrics else None

        assert "fanout_auth_jwks_keys 1.0" in wait_for(failed_once, "a failed fetch")
        assert _auth(ws, _token(keys["ec"], "ES256", "k-ec"), 2)["type"] == "reply"  # still checked


def test_a_token_naming_its_own_key_url_is_never_fetched(keyset, keys):
    """CVE-2026-32301 (Centrifugo): a key URL taken from the token. Here `jku` / `x5u` are never read: the
    attacker's server, publishing the attacker's key under the kid the token names, gets no request."""
    attacker = KeySetServer()
    attacker.publish(("k-evil", keys["ec_attacker"]))
    attacker.thread.start()
    try:
        keyset.publish(("k-ec", keys["ec"]))
        with _gateway(keyset) as gw:
            forged = _token(keys["ec_attacker"], "ES256", "k-evil", jku=attacker.url, x5u=attacker.url)
            codes: list[int] = []
            deadline = time.monotonic() + 10
            while 4001 not in codes and time.monotonic() < deadline:  # try again later (1013) until a set
                with ws_connect(gw, query=f"?token={forged}") as ws, pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=5)  # fetched since lacks the kid: 4001
                codes.append(closed.value.rcvd.code)
                time.sleep(0.2)
            assert codes[0] == 1013 and codes[-1] == 4001 and set(codes) == {1013, 4001}, codes
            # and an HS256 token signed with a published public key as its secret: no secret, no HS256
            with ws_connect(gw) as ws:
                hs = jwt.encode(
                    {"sub": "u1", "exp": int(time.time()) + 600}, keyset.keys[0]["x"], algorithm="HS256", headers={"kid": "k-ec"}
                )
                answer = _auth(ws, hs, 1)
                assert answer["code"] == "bad_token" and "'HS256' is not accepted" in answer["message"], answer
        assert attacker.requests == []
    finally:
        attacker.httpd.shutdown()
        attacker.httpd.server_close()


def test_cache_control_max_age_schedules_the_refresh_within_the_floor(keyset, keys):
    """max-age=0 is held at jwks_refresh_min_s (no hammering); without a token asking, the set is fetched
    again on that schedule, so a key rotated in is there before any client needs it."""
    keyset.publish(("k-ec", keys["ec"]))
    keyset.cache_control = "public, max-age=0"
    with _gateway(keyset, jwks_refresh_min_s=1.0, jwks_cache_max_s=60.0):
        started = keyset.requests[0]
        wait_for(lambda: len(keyset.requests) >= 3, "two fetches after the one at start", timeout=10)
        fetched = list(keyset.requests)
    # at start, then about one a second: never closer than the floor (max-age=0 would be at once), on time
    gaps = [round(b - a, 2) for a, b in zip(fetched, fetched[1:])]
    assert all(gap >= 0.8 for gap in gaps) and fetched[2] - started < 3.5, gaps
