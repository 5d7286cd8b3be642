"""The Starlette application: WebSocket, long-poll, admin API, metrics, health, static files."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from . import admin, longpoll
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


def build_app(hub: Hub, admin_token: str) -> Starlette:
    routes = [
        WebSocketRoute("/ws", websocket_endpoint),
        Route("/lp", longpoll.create_session, methods=["POST"]),
        Route("/lp/{session}", longpoll.poll, methods=["GET"]),
        Route("/lp/{session}", longpoll.post_commands, methods=["POST"]),
        Route("/lp/{session}", longpoll.delete_session, methods=["DELETE"]),
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
    app.state.admin_token = admin_token
    return app
