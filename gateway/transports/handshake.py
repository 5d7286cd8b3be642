"""How the HTTP transports (SSE, long-poll) answer a refused handshake (the refusals themselves, and which
transport gets which: gateway/admission.py), the close reason a WebSocket gets for one, and the one
answer of every route of a transport that is switched off (`TransportOff`)."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from core.errors import RequestError

from .. import close_codes
from ..admission import TooManyPendingConnects
from ..config import GatewayConfig
from ..edge.http_errors import error_response
from ..errors import BackendUnavailable, Closed, NotFound
from ..pending_connects import LateRefusal

#: seconds a client refused by a session bound should wait (`Retry-After`)
RETRY_SESSIONS_S = "5"


def http_refusal(config: GatewayConfig, exc: RequestError) -> Response:
    """A handshake's refusal as POST /lp and GET /sse answer it: `WWW-Authenticate: Bearer` with a refused
    token (401), `Retry-After` with the others: `proxy.retry_after_s` for the backend's (busy, down), 5 s
    for the session bounds."""
    if exc.http_status == 401:
        return error_response(exc, {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, TooManyPendingConnects | BackendUnavailable):  # the connect hook busy or down
        return error_response(exc, {"Retry-After": str(config.proxy.retry_after_s)})
    if exc.http_status in (429, 503):
        return error_response(exc, {"Retry-After": RETRY_SESSIONS_S})
    return error_response(exc)


#: HTTP status of a `LateRefusal` on POST /lp, by close code (a refused token, the admin's refusal, come back)
_LATE_STATUS = {close_codes.TOKEN_REVOKED: 401, close_codes.DISCONNECTED: 403, close_codes.SERVICE_RESTART: 503}


def late_refusal_response(refusal: LateRefusal) -> Response:
    """POST /lp's answer to a client closed as it would register: the `closed` entry's fields as the error
    (`close_code`, and `retry_ms` after a drain, with `Retry-After` in whole seconds), 401 (revoked, with
    `WWW-Authenticate: Bearer`), 403 (disconnected by an operator) or 503 (draining)."""
    error: dict[str, object] = {"code": Closed.code, "message": refusal.reason, "close_code": refusal.code}
    headers = {}
    if refusal.code == close_codes.TOKEN_REVOKED:
        headers["WWW-Authenticate"] = "Bearer"
    if refusal.retry_ms is not None:
        error["retry_ms"] = refusal.retry_ms
        headers["Retry-After"] = str(math.ceil(refusal.retry_ms / 1000))
    return JSONResponse({"error": error}, status_code=_LATE_STATUS.get(refusal.code, 503), headers=headers)


def close_reason(exc: RequestError) -> str:
    """A refusal's message as a WebSocket close reason: at most 120 bytes of UTF-8 (a close frame's reason
    takes at most 123), cut on a character boundary."""
    return exc.message.encode()[:120].decode(errors="ignore")


class TransportOff:
    """The endpoint of every route of an HTTP transport that is switched off (`longpoll.enabled`,
    `sse.enabled`): `404 not_found` naming the key. (`websocket.enabled` off: the WebSocket protocol answers
    every handshake 403 itself, gateway/transports/ws_handshake.py.)"""

    def __init__(self, name: str, key: str) -> None:
        self.refusal = NotFound(f"the {name} transport is disabled ({key})")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(self.refusal)(scope, receive, send)
