"""The Starlette application: WebSocket, long-poll, SSE, admin API, metrics, health, static files."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from . import admin, longpoll, sse
from .errors import MethodNotAllowed, NotFound
from .http_errors import error_response
from .hub import Hub
from .origin import OriginGuard, parse_allowed_origins
from .ws import websocket_endpoint


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    return Response(hub.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(NotFound(f"no route {request.url.path}"))


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(MethodNotAllowed(request.method))


async def longpoll_disabled(request: Request) -> Response:
    return error_response(NotFound("the long-poll transport is disabled (longpoll.enabled)"))


async def websocket_disabled(websocket: WebSocket) -> None:
    await websocket.close()  # before accept: the handshake is answered with HTTP 403


def build_app(hub: Hub, admin_token: str) -> Starlette:
    lp_on = hub.config.longpoll.enabled
    routes = [
        WebSocketRoute("/ws", websocket_endpoint if hub.config.websocket.enabled else websocket_disabled),
        Route("/lp", longpoll.create_session if lp_on else longpoll_disabled, methods=["POST"]),
        Route("/lp/{session}", longpoll.poll if lp_on else longpoll_disabled, methods=["GET"]),
        Route("/lp/{session}", longpoll.post_commands if lp_on else longpoll_disabled, methods=["POST"]),
        Route("/lp/{session}", longpoll.delete_session if lp_on else longpoll_disabled, methods=["DELETE"]),
        # sse checks sse.enabled itself: the endpoints answer 404 when it is off
        Route("/sse", sse.stream, methods=["GET"]),
        Route("/sse/{session}", sse.post_commands, methods=["POST"]),
        Route("/sse/{session}", sse.delete_session, methods=["DELETE"]),
        Mount("/api", routes=admin.routes),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
    ]
    static = hub.config.static_path()
    if static.is_dir():
        routes.append(Mount("/", StaticFiles(directory=static, html=True), name="static"))
    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: method_not_allowed},
        middleware=[Middleware(OriginGuard, allowed=parse_allowed_origins(hub.config.server.allowed_origins))],
    )
    app.state.hub = hub
    app.state.sse_sessions = {}  # SSE streams by their secret (gateway/sse.py)
    app.state.admin_token = admin_token
    return app
