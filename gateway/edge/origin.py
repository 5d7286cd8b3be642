"""Origin checks for the browser-facing routes (/ws, /lp, /sse): cross-site WebSocket hijacking and CORS.

A browser always sends `Origin` on a WebSocket handshake and on cross-origin requests. A request whose
Origin is neither the gateway's own (its host:port equals the request's Host) nor in
`server.allowed_origins` is refused: a WebSocket handshake with HTTP 403, a long-poll or SSE request with a
403 JSON error. Requests without Origin (services, curl) are not browsers acting for a third-party site and
pass. Allowed cross-origin requests get CORS headers, and preflight requests (OPTIONS) are answered here.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config import ConfigError
from ..errors import ForbiddenOrigin
from .http_errors import error_response

#: Routes a browser page reaches with the user's cookies and network position.
GUARDED_PREFIXES = ("/ws", "/lp", "/sse")
DEFAULT_PORTS = {"http": "80", "https": "443"}
CORS_METHODS = b"GET, POST, DELETE, OPTIONS"
CORS_HEADERS = b"Authorization, Content-Type, Last-Event-ID"
#: Seconds a browser may cache a preflight answer.
CORS_MAX_AGE = b"600"


def _normalize(origin: str) -> str | None:
    """`scheme://host[:port]` lower-cased, default port dropped; None when it is not such an origin."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:  # e.g. "http://[::1" or a port out of range
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6 literal
    netloc = host if port is None or str(port) == DEFAULT_PORTS[parts.scheme] else f"{host}:{port}"
    return f"{parts.scheme}://{netloc}"


def _same_host(origin: str, host: str | None) -> bool:
    if not host:
        return False
    scheme, _, netloc = origin.partition("://")
    host = host.strip().lower()
    default = ":" + DEFAULT_PORTS[scheme]
    if host.endswith(default):
        host = host[: -len(default)]
    return netloc == host


def parse_allowed_origins(allowed_origins: object) -> frozenset[str]:
    """The normalized origins of `server.allowed_origins` ("*" kept as is). Raises ConfigError."""
    if not isinstance(allowed_origins, list) or not all(isinstance(o, str) for o in allowed_origins):
        raise ConfigError("server.allowed_origins must be a list of origins (strings)")
    allowed = set()
    for origin in allowed_origins:
        normal = "*" if origin == "*" else _normalize(origin)
        if normal is None:
            raise ConfigError(f"server.allowed_origins: {origin!r} is not an origin like https://app.example.com")
        allowed.add(normal)
    return frozenset(allowed)


class OriginPolicy:
    """Which origins may use the guarded routes: the gateway's own, and `server.allowed_origins`."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.any = "*" in allowed
        self.allowed = allowed

    def allows(self, origin: str, host: str | None) -> bool:
        normal = _normalize(origin)
        if normal is None:  # "null" (sandboxed frames, file://) or garbage
            return self.any
        return self.any or normal in self.allowed or _same_host(normal, host)


class OriginGuard(OriginPolicy):
    """ASGI middleware in front of the app: refuses foreign origins on guarded routes, adds CORS headers."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        super().__init__(allowed)
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(GUARDED_PREFIXES):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        origin_text = origin.decode("latin-1")
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.allows(origin_text, host):
            return await self._refuse(scope, receive, send, origin_text)
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        cors = [
            (b"access-control-allow-origin", origin),
            (b"vary", b"Origin"),
            (b"access-control-expose-headers", b"Retry-After"),
        ]
        if scope["method"] == "OPTIONS":
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": cors
                    + [
                        (b"access-control-allow-methods", CORS_METHODS),
                        (b"access-control-allow-headers", CORS_HEADERS),
                        (b"access-control-max-age", CORS_MAX_AGE),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, origin: str) -> None:
        refusal = ForbiddenOrigin(f"origin {origin[:100]!r} is not allowed (server.allowed_origins)")
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            # before accept: uvicorn answers the handshake with HTTP 403
            await send({"type": "websocket.close", "code": refusal.close_code})
            return
        await error_response(refusal)(scope, receive, send)
