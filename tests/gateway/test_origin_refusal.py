"""The Origin guard's refusal goes through the one error path (errors.ForbiddenOrigin, http_errors.error_response)
and keeps its documented shape (docs/protocol.md): HTTP 403 with `{"error": {"code": "forbidden_origin", ...}}`,
no CORS headers; a WebSocket handshake closed before accept with 1008 (uvicorn answers it 403)."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from starlette.types import Message, Scope

from gateway import close_codes
from gateway.edge.origin import OriginGuard, parse_allowed_origins
from gateway.errors import ForbiddenOrigin

pytestmark = pytest.mark.unit

ALLOWED = "https://app.example.com"
HOST = b"gw.example:8080"


async def _never_called(scope, receive, send) -> None:
    raise AssertionError("a refused request reached the app")


def refuse(scope_type: str, origin: bytes, path: str = "/lp") -> list[Message]:
    """What the guard sends for a request from `origin` (one that it refuses)."""
    guard = OriginGuard(_never_called, parse_allowed_origins([ALLOWED]))
    scope: Scope = {
        "type": scope_type,
        "path": path,
        "method": "GET",
        "query_string": b"",
        "headers": [(b"host", HOST), (b"origin", origin)],
    }
    if scope_type == "websocket":
        del scope["method"]
    sent: list[Message] = []

    async def receive() -> Message:
        return (
            {"type": "websocket.connect"}
            if scope_type == "websocket"
            else {"type": "http.request", "body": b"", "more_body": False}
        )

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent


def test_the_http_refusal_is_the_documented_403_json_error():
    for path in ("/lp", "/lp/w1.abc", "/sse", "/sse/xyz"):
        start, body = refuse("http", b"https://evil.example", path)
        assert start["type"] == "http.response.start" and start["status"] == ForbiddenOrigin.http_status == 403
        headers = dict(start["headers"])
        assert headers[b"content-type"] == b"application/json"
        assert int(headers[b"content-length"]) == len(body["body"])
        assert not any(name.startswith(b"access-control-") for name in headers)
        assert body["body"] == orjson.dumps(
            {
                "error": {
                    "code": "forbidden_origin",
                    "message": "origin 'https://evil.example' is not allowed (server.allowed_origins)",
                }
            }
        )


def test_the_websocket_refusal_closes_before_accept_with_1008():
    assert refuse("websocket", b"https://evil.example", "/ws") == [
        {"type": "websocket.close", "code": close_codes.POLICY_VIOLATION}
    ]
    assert ForbiddenOrigin.close_code == 1008


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_any_refused_origin_gets_a_json_body_that_names_it_shortened(origin):
    text = origin.decode("latin-1")
    assume(not OriginGuard(None, parse_allowed_origins([ALLOWED])).allows(text, HOST.decode()))
    start, body = refuse("http", origin)
    assert start["status"] == 403
    # byte for byte what the guard wrote by hand before (orjson, compact)
    assert body["body"] == orjson.dumps(
        {"error": {"code": "forbidden_origin", "message": f"origin {text[:100]!r} is not allowed (server.allowed_origins)"}}
    )
