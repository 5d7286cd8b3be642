"""Admin REST API under /api, behind a bearer token. Errors are `{"error": {"code", "message"}}`."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import orjson
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core import QueueFull, RequestError, TopicConfig, TopicKind, UnknownTopic
from core.errors import MessageTooLarge

from .. import close_codes, schema
from ..auth.revocations import Revocation
from ..config import ConfigError, topic_config
from ..edge.bodies import read_body
from ..edge.http_errors import error_response
from ..errors import BadJson, BadRequest, BrokerUnavailable, Disabled, Unauthorized, UnknownClient
from ..hub import Hub
from ..ops.tracing import MAX_WATCHED, Tracing, traced_answer
from ..stats_feed import SnapshotStream, StatsFeed
from ..transports.ingest import ingest_counters
from .openapi import OPENAPI

UNAUTHORIZED = Unauthorized("a valid `Authorization: Bearer <token>` header is required")
DISABLED = Disabled("the raw TCP broadcaster is disabled")


def _hub(request: Request) -> Hub:
    hub: Hub = request.app.state.hub
    return hub


def _authorized(request: Request) -> bool:
    token = request.app.state.admin_token
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _json_body(request: Request) -> Any:
    # The bound is in bytes and checked before anything is decoded: decoding is what a body costs the loop
    # (~5 ms per MiB), so a body of millions of tiny messages never gets to the message count.
    body = await read_body(request, _hub(request).config.admin.max_body_bytes, "admin.max_body_bytes")
    if not body:
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadJson(f"not JSON: {exc}") from None


Endpoint = Callable[[Request], Awaitable[Response]]


def guarded(handler: Endpoint) -> Endpoint:
    async def answer(request: Request) -> Response:
        if not _authorized(request):
            return error_response(UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except RequestError as exc:
            return error_response(exc)

    name = f"admin {handler.__name__}"

    async def endpoint(request: Request) -> Response:
        return await traced_answer(_hub(request).tracing, name, request, answer)

    endpoint.__name__ = handler.__name__
    endpoint.__doc__ = handler.__doc__
    return endpoint


@guarded
async def list_topics(request: Request) -> Response:
    return JSONResponse({"topics": await _hub(request).catalog.topics_info()})


@guarded
async def create_topic(request: Request) -> Response:
    hub = _hub(request)
    body: schema.CreateTopic = schema.body(await _json_body(request), schema.CreateTopic)
    # Settings not given come from the rule the name matches (its permissions included), as on first use.
    rule = hub.topics.config.rule_for(body.name)
    try:
        config = topic_config({**(rule.as_dict() if rule is not None else {}), **body.settings()})
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    return JSONResponse(await hub.catalog.create_topic(body.name, config), status_code=201)


@guarded
async def get_topic(request: Request) -> Response:
    return JSONResponse(await _hub(request).catalog.topic_info(request.path_params["name"]))


@guarded
async def topic_presence(request: Request) -> Response:
    """A topic's presence: {"topic", "clients", "users", "members": [...] or null above
    limits.presence_max_members} (cluster-wide with a broker)."""
    hub = _hub(request)
    name = request.path_params["name"]
    config = hub.topics.topic_config(name)
    if config is None:
        raise UnknownTopic(f"no topic {name[:256]!r} and no rule creates it")
    if not config.presence:
        raise BadRequest(f"topic {name[:256]!r} has no presence (topic setting `presence`)")
    view = await hub.broker.presence.view(name, hub.config.limits.presence_max_members)
    return JSONResponse(view.as_dict())


@guarded
async def delete_topic(request: Request) -> Response:
    name = request.path_params["name"]
    return JSONResponse({"deleted": name, "subscribers_notified": await _hub(request).catalog.delete_topic(name)})


#: A bulk publish (`messages`) runs this long at most before it yields to the event loop.
BULK_SLICE_S = 0.002


@guarded
async def publish(request: Request) -> Response:
    """Body: {"data": D} or {"messages": [D, ...]}, optional "client" (private topics) and "seq"."""
    hub = _hub(request)
    name = request.path_params["name"]
    body: schema.PublishBody = schema.body(await _json_body(request), schema.PublishBody)
    items = body.items()
    bound = hub.config.admin.max_publish_messages
    if len(items) > bound:
        raise MessageTooLarge(f"at most {bound} messages per publish (admin.max_publish_messages), not {len(items)}")
    topic_config = hub.catalog.topic_config(name)
    if topic_config is None:
        raise UnknownTopic(f"no topic {name!r} and no rule creates it")
    tracing = hub.tracing
    if not tracing.recording():  # not sampled (or tracing off): no span below the request's
        return await _publish_items(hub, name, items, body, topic_config)
    with tracing.span("broker.publish", {"messaging.destination.name": name, "fanout.messages": len(items)}):
        return await _publish_items(hub, name, items, body, topic_config, traced=True)


async def _publish_items(
    hub: Hub, name: str, items: list[Any], body: schema.PublishBody, config: TopicConfig, traced: bool = False
) -> Response:
    """Publish each item through the broker; `traced`: the last one's apply and fan-out are traced beneath
    the current (sampled) span (gateway/ops/tracing.py)."""
    timeout = hub.config.admin.publish_timeout_s
    seqs: list[int] = []
    slice_started = time.perf_counter()
    last = len(items) - 1
    for index, data in enumerate(items):
        if time.perf_counter() - slice_started > BULK_SLICE_S:
            # A publish that lands at once (in-process) never awaits: yield, so other clients are served.
            await asyncio.sleep(0)
            slice_started = time.perf_counter()
        if traced and index == last:
            _expect_apply(hub, name, hub.tracing)
        try:
            private = config.kind is TopicKind.PRIVATE  # a full queue holds the publish up to `timeout`
            result = await hub.catalog.publish(name, data, owner=body.client, seq=body.seq, timeout=timeout if private else None)
        except BrokerUnavailable as exc:
            return error_response(exc, {"Retry-After": "1"})
        except (QueueFull, asyncio.TimeoutError):
            return error_response(
                QueueFull(f"private queue still full after {timeout} s; {len(seqs)} of {len(items)} published"),
                {"Retry-After": "1"},
            )
        seqs.append(result.seq)
    return Response(msgspec.json.encode(schema.PublishReply(name, seqs)), media_type="application/json")


def _expect_apply(hub: Hub, topic: str, tracing: Tracing) -> None:
    """The next apply of `topic` continues the current (sampled) span, within gateway/ops/tracing.py MAX_WATCHED."""
    scheduler = hub.scheduler
    if len(scheduler.traced_applies) + len(scheduler.fanouts) >= MAX_WATCHED:
        return
    expected = tracing.expect_apply()
    if expected is not None:
        scheduler.traced_applies[topic] = expected


#: `GET /api/clients` lists at most this many clients (each node sends at most this many of its own).
CLIENTS_LIST_MAX = 1000


async def _control(hub: Hub, command: dict[str, Any]) -> list[dict[str, Any]]:
    """Run an operator's command on every node (gateway/broker/control.py); Redis lost: 503."""
    return await hub.broker.control(command)


@guarded
async def list_clients(request: Request) -> Response:
    """Every node's clients (with a broker), at most CLIENTS_LIST_MAX, each with its `node`."""
    try:
        answers = await _control(_hub(request), {"op": "list", "limit": CLIENTS_LIST_MAX})
    except BrokerUnavailable as exc:
        return error_response(exc, {"Retry-After": "1"})
    clients = []
    for answer in answers:
        clients += [{**client, "node": answer["node"]} for client in answer.get("clients", ())]
    total = sum(answer.get("total", 0) for answer in answers)
    return JSONResponse(
        {"clients": clients[:CLIENTS_LIST_MAX], "total": total, "nodes": len(answers), "truncated": total > CLIENTS_LIST_MAX}
    )


@guarded
async def kick_client(request: Request) -> Response:
    """The client is closed (4000) wherever it is connected."""
    client_id = request.path_params["client_id"]
    hub = _hub(request)
    if hub.clients.kick(client_id, close_codes.KICKED, "kicked by admin", "kicked"):
        return JSONResponse({"kicked": client_id})  # on this node: nobody else to ask
    try:
        answers = await _control(hub, {"op": "kick", "client": client_id})
    except BrokerUnavailable as exc:
        return error_response(exc, {"Retry-After": "1"})
    if not any(answer.get("kicked") for answer in answers):
        return error_response(UnknownClient(f"no client {client_id[:128]!r}"))
    return JSONResponse({"kicked": client_id})


@guarded
async def disconnect_user(request: Request) -> Response:
    """Every connection of the user, on every node, is closed with 4005."""
    user = request.path_params["user"]
    try:
        answers = await _control(_hub(request), {"op": "disconnect", "user": user})
    except BrokerUnavailable as exc:
        return error_response(exc, {"Retry-After": "1"})
    reply = schema.UserDisconnected(user, sum(a.get("disconnected", 0) for a in answers), len(answers))
    return Response(msgspec.json.encode(reply), media_type="application/json")


@guarded
async def revoke(request: Request) -> Response:
    """Revoke one token (`jti`) or a user's tokens issued before a time; holders are closed with 4010."""
    hub = _hub(request)
    body: schema.RevokeBody = schema.body(await _json_body(request), schema.RevokeBody)
    body.check()
    auth = hub.config.auth
    now = time.time()
    if isinstance(body.jti, str):
        expires_at = float(body.expires_at) if body.expires_at is not UNSET else now + auth.revocation_ttl_s
        entry = Revocation(expires_at + auth.leeway_s, jti=body.jti)
    else:
        assert isinstance(body.user, str)
        issued_before = float(body.issued_before) if body.issued_before is not UNSET else now
        entry = Revocation(issued_before + auth.revocation_ttl_s + auth.leeway_s, user=body.user, issued_before=issued_before)
    if entry.expires_at <= now:
        raise BadRequest("the tokens this names have all expired: nothing to revoke")
    try:
        answers = await _control(hub, {"op": "revoke", "entry": entry.as_dict()})
    except BrokerUnavailable as exc:
        return error_response(exc, {"Retry-After": "1"})
    return JSONResponse(
        {"revoked": answers[0]["entry"], "disconnected": sum(a.get("disconnected", 0) for a in answers), "nodes": len(answers)},
        status_code=201,
    )


@guarded
async def raw_receivers(request: Request) -> Response:
    raw = _hub(request).raw
    if raw is None:
        return error_response(DISABLED)
    return JSONResponse({"receivers": raw.receivers()})


@guarded
async def raw_stats(request: Request) -> Response:
    raw = _hub(request).raw
    if raw is None:
        return error_response(DISABLED)
    return JSONResponse(raw.stats())


@guarded
async def stats(request: Request) -> Response:
    hub = _hub(request)
    counters = hub.topics.counters.as_dict()
    cycles = counters["cycles"] or 1
    return JSONResponse(
        {
            "instance": hub.instance_id,
            "core": counters,
            "entries_per_cycle": counters["entries_emitted"] / cycles,
            "entries_per_batch": counters["entries_emitted"] / (counters["clients_served"] or 1),
            "clients": dict(hub.clients.by_transport),
            "write_blocked": len(hub.scheduler.blocked),
            "topics": hub.topics.topic_count,
            "disconnects": {f"{t}:{r}": n for (t, r), n in hub.clients.disconnects.items()},
            "ingest": {"records": ingest_counters.records, "errors": ingest_counters.errors},
            "raw": hub.raw.stats() if hub.raw is not None else None,
            "cluster": await hub.broker.cluster_stats(),
        }
    )


@guarded
async def list_tenants(request: Request) -> Response:
    """This node's tenants (`[fairness]`): what each was served, its share against its weight's."""
    return JSONResponse(_hub(request).scheduler.tenants())


async def openapi(request: Request) -> Response:
    return JSONResponse(OPENAPI)


routes = [
    Route("/openapi.json", openapi),
    Route("/topics", list_topics, methods=["GET"]),
    Route("/topics", create_topic, methods=["POST"]),
    Route("/topics/{name:path}/publish", publish, methods=["POST"]),
    Route("/topics/{name:path}/presence", topic_presence, methods=["GET"]),
    Route("/topics/{name:path}", get_topic, methods=["GET"]),
    Route("/topics/{name:path}", delete_topic, methods=["DELETE"]),
    Route("/clients", list_clients, methods=["GET"]),
    Route("/clients/{client_id}", kick_client, methods=["DELETE"]),
    Route("/users/{user}", disconnect_user, methods=["DELETE"]),
    Route("/revocations", revoke, methods=["POST"]),
    Route("/raw/receivers", raw_receivers, methods=["GET"]),
    Route("/raw/stats", raw_stats, methods=["GET"]),
    Route("/stats", stats, methods=["GET"]),
    Route("/tenants", list_tenants, methods=["GET"]),
]


# -- read-only: which rule would create a topic (the Spark feed reads it before a topic exists) ------------


@guarded
async def get_rule(request: Request) -> Response:
    """The `[[topics.rules]]` entry a topic name is created by on first use: its pattern and settings."""
    name = request.path_params["name"]
    for rule in _hub(request).topics.config.rules:
        if rule.matches(name):
            return JSONResponse({"name": name, "pattern": rule.pattern, **rule.config.as_dict()})
    raise UnknownTopic(f"no topic rule matches {name[:256]!r}: create the topic with POST /api/topics")


routes.append(Route("/rules/{name:path}", get_rule, methods=["GET"]))


# -- the live stats stream: GET /api/stats/stream, read by the dashboard at /admin/ (gateway/stats_feed.py) --


def _feed(request: Request) -> StatsFeed:
    return _hub(request).stats


@guarded
async def stats_stream(request: Request) -> Response:
    """Server-sent events: one `data:` JSON snapshot every `admin.stats_interval_s` (docs/protocol.md)."""
    return SnapshotStream(_feed(request))


routes.append(Route("/stats/stream", stats_stream, methods=["GET"]))
