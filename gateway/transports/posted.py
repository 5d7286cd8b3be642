"""What the HTTP client transports (long-poll, SSE) share past their handshake: the connect hook's answer
as HTTP, and the commands a client POSTs."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core import RequestError

from ..edge.bodies import read_body
from ..edge.http_errors import error_response
from ..errors import BadJson
from ..session import ClientSession
from .handshake import http_refusal


async def backend_refusal(session: ClientSession, request: Request) -> Response | None:
    """The connect hook for an HTTP transport (long-poll, SSE), when the client must pass it: None once the
    backend admitted it, else the answer: 403 `forbidden` (refused), 503 `backend_unavailable` with
    `Retry-After` (no answer in time)."""
    if not session.awaits_hook:
        return None
    try:
        await session.pass_backend(request.headers.getlist)
    except RequestError as exc:
        return http_refusal(session.config, exc)
    return None


async def accept_commands(request: Request, session: ClientSession, max_body_bytes: int) -> Response:
    """A POSTed command or array of commands, run for `session`'s client (long-poll, SSE): `202 {"accepted":
    n}`, the answers on the client's stream; a body that is too large or not JSON is a 4xx JSON error."""
    try:
        body = await read_body(request, max_body_bytes)
    except RequestError as exc:
        return error_response(exc)
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return error_response(BadJson(f"not JSON: {exc}"))
    count = session.handle(body)
    return JSONResponse({"accepted": count}, status_code=202)
