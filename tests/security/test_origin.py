"""Cross-site WebSocket hijacking and CORS: browsers from foreign origins are refused (issue 8, Origin row)."""

from __future__ import annotations

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import recv_entries, send

pytestmark = pytest.mark.timeout(60)


def handshake(gw, origin: str | None):
    headers = {"Origin": origin} if origin else {}
    return connect(gw.ws_url, additional_headers=headers, open_timeout=5, compression=None)


def test_a_websocket_handshake_from_a_foreign_origin_is_refused_with_403():
    with run_gateway(server={"allowed_origins": ["https://app.example.com"]}) as gw:
        for origin in ("https://evil.example", "null", "http://app.example.com", "https://app.example.com.evil.example"):
            with pytest.raises(InvalidStatus) as info:
                handshake(gw, origin)
            assert info.value.response.status_code == 403, origin
        own = f"http://127.0.0.1:{gw.http_port}"
        for origin in (own, "https://app.example.com", "HTTPS://APP.EXAMPLE.COM:443", None):
            with handshake(gw, origin) as ws:
                send(ws, op="ping", id=1)
                assert recv_entries(ws)[0]["result"] == "pong", origin


def test_star_allows_every_origin_explicitly():
    with run_gateway(server={"allowed_origins": ["*"]}) as gw, handshake(gw, "https://anyone.example") as ws:
        send(ws, op="ping", id=1)
        assert recv_entries(ws)[0]["result"] == "pong"


def test_long_poll_answers_cors_for_allowed_origins_and_403_for_others():
    allowed = "https://app.example.com"
    with run_gateway(server={"allowed_origins": [allowed]}) as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        preflight = http.options(
            "/lp",
            headers={
                "Origin": allowed,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == allowed
        assert "Authorization" in preflight.headers["access-control-allow-headers"]
        created = http.post("/lp", headers={"Origin": allowed})
        assert created.status_code == 201 and created.headers["access-control-allow-origin"] == allowed
        session = created.json()["session"]
        for method, path in (("POST", "/lp"), ("GET", f"/lp/{session}"), ("DELETE", f"/lp/{session}"), ("OPTIONS", "/lp")):
            r = http.request(method, path, headers={"Origin": "https://evil.example"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin", (method, path)
            assert "access-control-allow-origin" not in r.headers
        assert http.delete(f"/lp/{session}").status_code == 204  # services without Origin are unaffected


def test_a_bad_allowed_origins_setting_is_refused_at_start():
    from gateway.config import ConfigError

    with pytest.raises(ConfigError):
        with run_gateway(server={"allowed_origins": ["app.example.com"]}):
            pass
