"""Token checks (issue 24): a token of the other public-key algorithm is a bad token like any other (it raised
an uncaught error: 500 / 1011 and tracebacks), and token checks are rate-limited per connection and per
address (bad 4096-bit RS256 signatures took 93% of the CPU from one client)."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from websockets.exceptions import ConnectionClosed

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import collect, send, ws_connect

pytestmark = pytest.mark.timeout(60)


def _pem(private) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def keys():
    return {
        "RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ES256": ec.generate_private_key(ec.SECP256R1()),
    }


def _token(keys, alg: str, sub: str = "u1") -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time()) + 600}, keys[alg], algorithm=alg)


def _gateway(tmp_path, keys, key_alg: str, **overrides):
    path = tmp_path / f"{key_alg}.pem"
    path.write_bytes(_pem(keys[key_alg]))
    return run_gateway(auth={"jwt_secret": "", "jwt_public_key_file": str(path), **overrides.pop("auth", {})}, **overrides)


def _close_code(gw, query: str) -> int:
    with ws_connect(gw, query=query) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
    assert closed.value.rcvd is not None, "the server sent no close frame"
    return closed.value.rcvd.code


@pytest.mark.parametrize("key_alg,token_alg", [("RS256", "ES256"), ("ES256", "RS256")])
def test_a_token_of_the_other_public_key_algorithm_is_a_bad_token(tmp_path, keys, key_alg, token_alg):
    with _gateway(tmp_path, keys, key_alg) as gw:
        other = _token(keys, token_alg)
        assert _close_code(gw, f"?token={other}") == 4001  # was 1011 (an uncaught InvalidKeyError)
        with ws_connect(gw) as ws:
            send(ws, op="auth", token=other, id=1)
            answer = collect(ws, lambda got: any(e.get("id") == 1 for e in got))[-1]
            assert answer["type"] == "error" and answer["code"] == "bad_token", answer
            send(ws, op="auth", token=_token(keys, key_alg), id=2)  # its own algorithm still works
            answer = collect(ws, lambda got: any(e.get("id") == 2 for e in got))[-1]
            assert answer["type"] == "reply" and answer["result"]["user"] == "u1"
        with web.Client(base_url=gw.http_url, timeout=10) as http:
            answer = http.post("/lp", headers={"Authorization": f"Bearer {other}"})
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "bad_token"  # was 500


def test_auth_commands_are_rate_limited_per_connection(tmp_path, keys):
    with _gateway(tmp_path, keys, "RS256") as gw, ws_connect(gw) as ws:
        bad = _token(keys, "RS256")[:-6] + "AAAAAA"
        ws.send("[" + ",".join(f'{{"op":"auth","token":"{bad}","id":{i}}}' for i in range(100)) + "]")
        got = collect(ws, lambda got: any(e.get("id") == 99 for e in got))
        codes = [e["code"] for e in got if e["type"] == "error"]
        assert codes == ["bad_token"] * 5 + ["rate_limited"] * 95  # burst_per_connection = 5


def test_token_checks_are_rate_limited_per_address(tmp_path, keys):
    limits = {"auth": {"rate_per_ip": 1.0, "burst_per_ip": 3}}
    with _gateway(tmp_path, keys, "RS256", **limits) as gw:
        bad = _token(keys, "RS256")[:-6] + "AAAAAA"
        codes = [_close_code(gw, f"?token={bad}") for _ in range(5)]
        assert codes == [4001, 4001, 4001, 4029, 4029]  # a new connection does not start a new count
        with web.Client(base_url=gw.http_url, timeout=10) as http:
            answer = http.post("/lp", headers={"Authorization": f"Bearer {bad}"})
            assert answer.status_code == 429 and answer.json()["error"]["code"] == "rate_limited"
        metrics = web.get(gw.http_url + "/metrics").text
        assert "fanout_auth_rate_limited_total 3.0" in metrics
