"""The Centrifugo server API's routes: `POST PREFIX/METHOD` (`centrifugo.api_prefix`, default "/api"), as the
`cent` client calls them (docs/centrifugo.md, "Server API").

The key is our admin token, in `X-API-Key: KEY` or `Authorization: apikey KEY` (or `Bearer`, as our admin
API takes it); a missing or wrong key is HTTP 401 (cent: `CentUnauthorizedError`). Everything else is HTTP 200
with `{"result": ...}` or `{"error": {"code", "message"}}`, and `batch` answers `{"replies": [...]}`.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount, Route

from core import RequestError
from core.errors import MessageTooLarge

from ..config import ConfigError
from ..edge.bodies import read_body
from ..hub import Hub
from ..ops.tracing import traced_answer
from . import api_requests as req
from .api_errors import BAD_REQUEST, LIMIT_EXCEEDED, ApiError, bad_request
from .api_methods import METHODS, NOT_SUPPORTED, as_api_error, call, in_slices
from .context import ApiContext
from .history import HistoryBudget


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status_code=status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    return _json({"error": exc.as_dict()})


def _authorized(request: Request) -> bool:
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, rest = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() not in ("apikey", "bearer"):
            return False
        given = rest.strip()
    token: str = request.app.state.admin_token
    return hmac.compare_digest(given.encode(), token.encode())


UNAUTHORIZED = {
    "error": {"code": 101, "message": "unauthorized: a valid `X-API-Key: KEY` or `Authorization: apikey KEY` header is required"}
}


async def _params(request: Request, hub: Hub) -> Any:
    """The request's JSON body (`{}` when empty), within admin.max_body_bytes."""
    try:
        body = await read_body(request, hub.config.admin.max_body_bytes, "admin.max_body_bytes")
    except MessageTooLarge as exc:
        raise ApiError(LIMIT_EXCEEDED, exc.message) from None
    except RequestError as exc:
        raise bad_request(exc.message) from None
    if not body:
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"not JSON: {exc}") from None


async def _batch(ctx: ApiContext, params: Any) -> dict[str, Any]:
    """Each command `{"METHOD": PARAMS}` in order (`parallel` changes nothing but the order of work), its
    reply `{"METHOD": RESULT}` or `{"error"}`: one command's refusal stops no other."""
    batch: req.Batch = req.parse(params, req.Batch)
    bound = ctx.hub.config.admin.max_publish_messages
    if len(batch.commands) > bound:
        raise ApiError(LIMIT_EXCEEDED, f"at most {bound} commands per batch (admin.max_publish_messages)")
    replies: list[dict[str, Any]] = []
    budget = HistoryBudget()  # the batch's history answers together: as much as one `history` call's
    async for command in in_slices(batch.commands):
        replies.append(await _batch_reply(ctx, command, budget))
    return {"replies": replies}


async def _batch_reply(ctx: ApiContext, command: dict[str, Any], budget: HistoryBudget) -> dict[str, Any]:
    if len(command) != 1:
        return {"error": ApiError(BAD_REQUEST, 'a batch command is one {"METHOD": {...}} object').as_dict()}
    name, params = next(iter(command.items()))
    if name == "batch":
        return {"error": ApiError(BAD_REQUEST, "a batch cannot hold a batch").as_dict()}
    try:
        return {name: await call(ctx, name, params, budget)}
    except Exception as exc:
        return {"error": as_api_error(exc).as_dict()}


def _endpoint(ctx: ApiContext, name: str) -> Any:
    span_name = f"centrifugo {name}"

    async def endpoint(request: Request) -> Response:
        return await traced_answer(ctx.hub.tracing, span_name, request, answer)

    async def answer(request: Request) -> Response:
        if not _authorized(request):
            return _json(UNAUTHORIZED, 401)
        try:
            params = await _params(request, ctx.hub)
            if name == "batch":
                return _json(await _batch(ctx, params))
            return _json({"result": await call(ctx, name, params)})
        except (ApiError, RequestError) as exc:
            return _error(as_api_error(exc))

    endpoint.__name__ = f"centrifugo_{name}"
    return endpoint


def routes(hub: Hub, prefix: str, existing: Sequence[BaseRoute]) -> list[Route]:
    """The API's routes, to go before `existing` (the app's other routes). Raises ConfigError when one of
    them would take a POST some existing route serves."""
    ctx = ApiContext(hub)
    paths = {name: f"{prefix}/{name}" for name in [*METHODS, "batch", *NOT_SUPPORTED]}
    taken = [path for path in paths.values() if _served(existing, path)]
    if taken:
        raise ConfigError(
            f"centrifugo.api_prefix {prefix!r}: POST {taken[0]} is already a route of the gateway; "
            "choose another prefix (docs/centrifugo.md)"
        )
    return [Route(path, _endpoint(ctx, name), methods=["POST"]) for name, path in paths.items()]


def _served(routes: Sequence[BaseRoute], path: str) -> bool:
    """Whether a POST to `path` reaches one of `routes`."""
    return _serves(routes, {"type": "http", "method": "POST", "path": path, "root_path": ""})


def _serves(routes: Sequence[BaseRoute], scope: dict[str, Any]) -> bool:
    """Starlette's own matching, into mounts (a mount of an app without routes, like the static pages, serves
    GET only)."""
    for route in routes:
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        if not isinstance(route, Mount):
            return True
        if route.routes and _serves(route.routes, {**scope, **child}):
            return True
    return False
