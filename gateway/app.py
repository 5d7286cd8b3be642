"""The Starlette application: WebSocket, long-poll, SSE, admin API, metrics, health, static files."""

from __future__ import annotations

import logging
import mimetypes

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from .admin import api as admin
from .admin.pages import Pages
from .centrifugo import api as centrifugo
from .edge.http_errors import error_response
from .edge.origin import OriginGuard, OriginPolicy, parse_allowed_origins
from .edge.page_headers import SecurityHeaders
from .errors import MethodNotAllowed, NotFound
from .hub import Hub
from .ops.readiness import readyz
from .stats_feed import StatsFeed
from .transports import longpoll, sse
from .transports.handshake import TransportOff
from .workers.forward import SessionRouter, WorkerLinks

# The client library's type declarations (static/fanout.d.ts): the system table may call .ts a Qt file.
mimetypes.add_type("application/typescript", ".ts")

log = logging.getLogger(__name__)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    return Response(hub.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(NotFound(f"no route {request.url.path}"))


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(MethodNotAllowed(request.method))


def build_app(hub: Hub, admin_token: str, links: WorkerLinks | None = None) -> Starlette:
    """`links`: with `server.workers` > 1, session requests owned by another worker go to it
    (gateway/workers/forward.py), inside the Origin guard, which this worker answers itself."""
    config = hub.config
    # every route of a transport that is off answers with its one `TransportOff` (404 not_found); /ws is not
    # an ASGI route: the WebSocket protocol answers its handshakes (gateway/transports/ws.py)
    lp_off = None if config.longpoll.enabled else TransportOff("long-poll", "longpoll.enabled")
    sse_off = None if config.sse.enabled else TransportOff("SSE", "sse.enabled")
    routes = [
        Route("/lp", lp_off or longpoll.create_session, methods=["POST"]),
        Route("/lp/{session}", lp_off or longpoll.poll, methods=["GET"]),
        Route("/lp/{session}", lp_off or longpoll.post_commands, methods=["POST"]),
        Route("/lp/{session}", lp_off or longpoll.delete_session, methods=["DELETE"]),
        Route("/sse", sse_off or sse.stream, methods=["GET"]),
        Route("/sse/{session}", sse_off or sse.post_commands, methods=["POST"]),
        Route("/sse/{session}", sse_off or sse.delete_session, methods=["DELETE"]),
        Mount("/api", routes=admin.routes),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
    ]
    if config.centrifugo.enabled:  # exact POST routes, before the admin API's mount that shares "/api"
        routes[:0] = centrifugo.routes(hub, config.centrifugo.api_prefix, routes)
    allowed = parse_allowed_origins(hub.config.server.allowed_origins)
    static = hub.config.static_path()
    if static.is_dir():
        routes.append(Mount("/", Pages(directory=str(static), policy=OriginPolicy(allowed)), name="static"))
    else:
        log.warning("no pages at %s (server.static_dir): /, /fanout.js and /admin/ answer 404", static)
    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: method_not_allowed},
        middleware=[Middleware(SecurityHeaders), Middleware(OriginGuard, allowed=allowed)]
        + ([Middleware(SessionRouter, links=links, config=hub.config)] if links is not None else []),
    )
    app.state.hub = hub
    #: what the client transports' endpoints reach (gateway/session_services.py), never the hub
    app.state.services = hub.services
    app.state.admin_token = admin_token
    # now, not at the first viewer: with a broker, another node's viewer may ask this node for its summary
    app.state.stats_feed = StatsFeed(hub)
    app.state.session_prefix = links.secret_prefix if links is not None else ""  # names the owning worker
    return app
