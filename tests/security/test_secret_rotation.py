"""Key rotation without refusing valid tokens (gateway/auth/tokens.py; docs/operations.md, "Key rotation"):
`auth.jwt_previous_secret` and `auth.jwt_previous_public_key_file` are accepted beside the current key until
they are removed from the config; `gateway check-config` checks them (and masks the previous secret)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from websockets.exceptions import ConnectionClosed

from gateway import cli
from gateway.testing import make_token, run_gateway
from tests.gateway.gw_helpers import collect, send, ws_connect

ROOT = Path(__file__).resolve().parents[2]
OLD = "the-old-secret-of-at-least-32-bytes-long"
NEW = "the-new-secret-of-at-least-32-bytes-long"


def _connects(gw, token: str) -> int | None:
    """None when a WebSocket with this token is taken (a ping is answered), else its close code."""
    with ws_connect(gw, query=f"?token={token}") as ws:
        try:
            send(ws, op="ping", id=1)
            collect(ws, lambda got: any(e.get("id") == 1 for e in got))
        except ConnectionClosed as closed:
            assert closed.rcvd is not None
            return closed.rcvd.code
    return None


def test_the_previous_secret_is_accepted_until_removed():
    old_token, new_token = make_token("u-old", secret=OLD), make_token("u-new", secret=NEW)
    with run_gateway(auth={"jwt_secret": NEW, "jwt_previous_secret": OLD}) as gw:
        assert _connects(gw, old_token) is None
        assert _connects(gw, new_token) is None
        assert _connects(gw, make_token("u", secret="some-other-secret-of-32-bytes-or-more")) == 4001
        # an expired token of the previous secret is told it expired (its signature matched), not bad_token
        with ws_connect(gw) as ws:
            send(ws, op="auth", token=make_token("u-old", secret=OLD, ttl=-60), id=2)
            answer = collect(ws, lambda got: any(e.get("id") == 2 for e in got))[-1]
            assert answer["code"] == "token_expired", answer
    with run_gateway(auth={"jwt_secret": NEW}) as gw:  # the rotation is over: the old secret is removed
        assert _connects(gw, old_token) == 4001
        assert _connects(gw, new_token) is None


def test_the_previous_public_key_is_accepted_until_removed(tmp_path):
    old_key, new_key = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2))
    files = {}
    for name, key in (("old", old_key), ("new", new_key)):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )

    def token(key: rsa.RSAPrivateKey) -> str:
        return jwt.encode({"sub": "u1", "exp": int(time.time()) + 600}, key, algorithm="RS256")

    auth = {"jwt_secret": "", "jwt_public_key_file": str(files["new"])}
    with run_gateway(auth={**auth, "jwt_previous_public_key_file": str(files["old"])}) as gw:
        assert _connects(gw, token(old_key)) is None
        assert _connects(gw, token(new_key)) is None
    with run_gateway(auth=auth) as gw:
        assert _connects(gw, token(old_key)) == 4001
        assert _connects(gw, token(new_key)) is None


def _check_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (f'[auth]\njwt_previous_secret = "{OLD}"\n', "auth.jwt_previous_secret is accepted beside auth.jwt_secret"),
        ('[auth]\njwt_previous_public_key_file = "/nonexistent.pem"\n', "beside auth.jwt_public_key_file"),
        (
            '[auth]\njwt_public_key_file = "{pem}"\njwt_previous_public_key_file = "/nonexistent.pem"\n',
            "auth.jwt_previous_public_key_file: cannot read /nonexistent.pem",
        ),
        ('[auth]\njwks_url = "http://keys.example.com/certs"\n', "auth.jwks_url must be an https:// URL"),
        ('[auth]\njwks_url = "ftp://localhost/certs"\n', "auth.jwks_url must be an https:// URL"),
        ("[auth]\njwks_refresh_min_s = 0.5\n", "auth.jwks_refresh_min_s must be >= 1"),
        ("[auth]\njwks_refresh_min_s = 60.0\njwks_cache_max_s = 30.0\n", "must be >= auth.jwks_refresh_min_s"),
        ("[server]\ndrain_delay_s = -1.0\n", "server.drain_delay_s must be >= 0"),
    ],
)
def test_check_config_refuses_bad_rotation_and_jwks_keys(tmp_path, current_pem, text, message, monkeypatch, capsys):
    # `gateway check-config`'s own function in this process (the command as a subprocess is the test below):
    # an interpreter start per case was most of this test's time
    for name in [k for k in os.environ if k.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "gateway.toml"
    path.write_text(text.replace("{pem}", str(current_pem)))
    returncode = cli.main(["check-config", str(path)])
    stderr = capsys.readouterr().err
    assert returncode == 2 and message in stderr, stderr


@pytest.fixture(scope="module")
def current_pem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pem = tmp_path_factory.mktemp("keys") / "current.pem"
    pem.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pem


def test_check_config_masks_the_previous_secret_and_takes_a_jwks_url(tmp_path):
    checked = _check_config(
        tmp_path,
        f'[auth]\njwt_secret = "{NEW}"\njwt_previous_secret = "{OLD}"\n'
        'jwks_url = "https://sso.example.com/realms/x/protocol/openid-connect/certs"\n',
    )
    assert checked.returncode == 0, checked.stderr
    auth = json.loads(checked.stdout)["auth"]
    assert auth["jwt_previous_secret"] == "<set>" and OLD not in checked.stdout
    assert auth["jwks_url"].startswith("https://sso.example.com/") and auth["jwks_refresh_min_s"] == 30.0
