"""The Centrifugo server API's methods over our topics (docs/centrifugo.md, "Server API"): a channel is a topic,
a publication's offset is its seq + 1; the methods on a user's connections are in api_users.py.

Each method takes its parsed request and returns its `result`, or raises ApiError (Centrifugo's codes) or a
RequestError of ours (mapped by the caller). A field we have no notion of is refused with 107, never ignored.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from importlib import metadata
from typing import Any, TypeVar

import orjson
from msgspec import UNSET, Struct

from core import RequestError, TopicConfig, TopicKind, UnknownTopic

from . import api_requests as req
from . import api_users as users
from .api_errors import (
    LIMIT_EXCEEDED,
    METHOD_NOT_FOUND,
    NOT_AVAILABLE,
    ApiError,
    bad_request,
    unsupported,
)
from .channel_glob import compile_pattern
from .context import ApiContext
from .history import MAX_BYTES, MAX_PUBLICATIONS, History, HistoryBudget, HistoryQuery, json_publications, position_only, read

T = TypeVar("T")

#: a broadcast (or a batch) runs this long at most before it yields to the event loop
SLICE_S = 0.002


async def in_slices(items: Iterable[T]) -> AsyncIterator[T]:
    """The items, yielding to the event loop every `SLICE_S`: a publish that lands at once never awaits, so a
    long broadcast or batch would otherwise keep every other client waiting."""
    slice_started = time.perf_counter()
    for item in items:
        if time.perf_counter() - slice_started > SLICE_S:
            await asyncio.sleep(0)
            slice_started = time.perf_counter()
        yield item


# -- publishing ------------------------------------------------------------------------------------------


def _check_publish_fields(request: req.Publish | req.Broadcast) -> None:
    if request.b64data is not None:
        raise unsupported("b64data", "messages are JSON values; send `data`")
    if request.data is UNSET:
        raise bad_request("`data` is required")
    if request.skip_history:
        raise unsupported("skip_history", "every message of a ring topic is in its ring, which is its history")
    if request.tags:
        raise unsupported("tags", "messages carry `data` only")


def _shared_topic(ctx: ApiContext, channel: str) -> TopicConfig:
    """The settings of a ring or snapshot topic (it exists or a rule creates it)."""
    config = ctx.hub.catalog.topic_config(channel)
    if config is None:
        raise UnknownTopic(f"no topic {channel[:256]!r} and no rule creates it")
    if config.kind is TopicKind.PRIVATE:
        raise ApiError(
            NOT_AVAILABLE,
            f"topic {channel[:256]!r} is a private queue, one per user, not a channel: "
            "publish to one with POST /api/topics/NAME/publish and its `client`",
        )
    return config


async def _epoch(ctx: ApiContext, channel: str) -> str:
    hub = ctx.hub
    if hub.topics.has_topic(channel):
        return hub.topics.topic(channel).epoch
    info = await hub.broker.topic_info(channel)  # held in Redis, not on this node
    return str(info["epoch"]) if info is not None else ""


async def _publish_one(ctx: ApiContext, channel: str, data: Any, idempotency_key: str | None) -> dict[str, Any]:
    """One message through the admin API's path: the same router, checks and limits; with a key, once."""

    async def publish() -> dict[str, Any]:
        _shared_topic(ctx, channel)
        published = await ctx.hub.catalog.publish(channel, data)
        return {"offset": published.seq + 1, "epoch": await _epoch(ctx, channel)}

    if idempotency_key is None:
        return await publish()
    return await ctx.idempotent.publish(channel, idempotency_key, publish)


async def publish(ctx: ApiContext, request: req.Publish) -> dict[str, Any]:
    _check_publish_fields(request)
    return await _publish_one(ctx, request.channel, request.data, request.idempotency_key)


async def broadcast(ctx: ApiContext, request: req.Broadcast) -> dict[str, Any]:
    """Each channel's answer in order, `{"result"}` or `{"error"}`: one channel's refusal stops no other."""
    _check_publish_fields(request)
    bound = ctx.hub.config.admin.max_publish_messages
    if len(request.channels) > bound:
        raise ApiError(LIMIT_EXCEEDED, f"at most {bound} channels per broadcast (admin.max_publish_messages)")
    responses: list[dict[str, Any]] = []
    async for channel in in_slices(request.channels):
        try:
            responses.append({"result": await _publish_one(ctx, channel, request.data, request.idempotency_key)})
        except Exception as exc:
            responses.append({"error": as_api_error(exc).as_dict()})
    return {"responses": responses}


def as_api_error(exc: Exception) -> ApiError:
    """What a method raised, as Centrifugo's error (anything unexpected is re-raised)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return ApiError.of(exc)
    raise exc


# -- reading ---------------------------------------------------------------------------------------------


async def _presence_view(ctx: ApiContext, channel: str, limit: int) -> Any:
    hub = ctx.hub
    config = hub.topics.topic_config(channel)
    if config is None:
        raise UnknownTopic(f"no topic {channel[:256]!r} and no rule creates it")
    if not config.presence:
        raise ApiError(NOT_AVAILABLE, f"topic {channel[:256]!r} has no presence (topic setting `presence`)")
    return await hub.broker.presence.view(channel, limit)


async def presence(ctx: ApiContext, request: req.Channel) -> dict[str, Any]:
    bound = ctx.hub.config.limits.presence_max_members
    view = await _presence_view(ctx, request.channel, bound)
    if view.members is None:
        raise ApiError(
            LIMIT_EXCEEDED, f"{view.clients} members, more than limits.presence_max_members ({bound}): ask presence_stats"
        )
    members: dict[str, Any] = {}
    for member in view.members:
        info = {"client": member.client, "user": member.user or ""}
        members[member.client] = info if member.info is None else {**info, "conn_info": member.info}
    return {"presence": members}


async def presence_stats(ctx: ApiContext, request: req.Channel) -> dict[str, Any]:
    view = await _presence_view(ctx, request.channel, 0)
    return {"num_clients": view.clients, "num_users": view.users}


async def history(ctx: ApiContext, request: req.History, budget: HistoryBudget | None = None) -> dict[str, Any]:
    """`budget`: what the call's answers may still hold (a `batch` shares one; HistoryBudget)."""
    if budget is not None and budget.spent and (request.limit or 0) != 0:
        raise ApiError(
            LIMIT_EXCEEDED,
            f"this call's history answers hold {MAX_PUBLICATIONS} publications or "
            f"{MAX_BYTES >> 20} MiB of data already: ask for the rest in another call",
        )
    return _history_result(await _history(ctx, request, budget))


async def _history(ctx: ApiContext, request: req.History, budget: HistoryBudget | None) -> History:
    hub = ctx.hub
    since = request.since
    query = HistoryQuery(request.limit or 0, None if since is None else (since.offset, since.epoch), bool(request.reverse))
    query.check()
    channel = request.channel
    if hub.topics.has_topic(channel):
        return read(hub.topics.topic(channel), query, budget)
    config = _shared_topic(ctx, channel)
    info = await hub.broker.topic_info(channel)
    if info is None:  # never published to: an empty stream
        return position_only(0, "")
    if query.limit != 0 or since is not None:
        raise ApiError(
            NOT_AVAILABLE,
            f"topic {channel[:256]!r} is held in Redis and this node has no subscriber "
            "of it: its publications are read on a node that has one",
        )
    top = info["seq"] + 1 if config.kind is TopicKind.SNAPSHOT else info["end"]
    return position_only(int(top), str(info["epoch"]))


def _history_result(history: History) -> dict[str, Any]:
    return {"publications": orjson.Fragment(json_publications(history.rows)), "offset": history.offset, "epoch": history.epoch}


async def channels(ctx: ApiContext, request: req.Channels) -> dict[str, Any]:
    """The topics with subscribers (with a broker: subscribers on this node, as GET /api/topics counts them)."""
    matches = compile_pattern(request.pattern) if request.pattern else None
    listed: dict[str, Any] = {}
    async for info in in_slices(await ctx.hub.catalog.topics_info()):
        name, count = info["name"], info.get("subscribers", 0)
        if count and (matches is None or matches(name)):
            listed[name] = {"num_clients": count}
    return {"channels": listed}


def _version() -> str:
    try:
        return metadata.version("fanout-gateway")
    except metadata.PackageNotFoundError:
        return ""


async def info(ctx: ApiContext, request: req.Info) -> dict[str, Any]:
    """This node, then with a broker the other live nodes (their clients and topics)."""
    hub = ctx.hub
    topics = hub.topics.topics()
    nodes = [
        {
            "uid": hub.broker.node_id,
            "name": f"{socket.gethostname()}:{hub.broker.node_id}",
            "version": _version(),
            "num_clients": len(hub.clients.conns),
            "num_users": len(hub.clients.by_user),
            "num_channels": len(topics),
            "num_subs": sum(len(topic.subs) for topic in topics),
            "uptime": int(time.monotonic() - ctx.started),
        }
    ]
    cluster = await hub.broker.cluster_stats()
    for node in (cluster or {}).get("nodes", ()):
        if node.get("node") != hub.broker.node_id:
            nodes.append(
                {
                    "uid": str(node.get("node")),
                    "name": str(node.get("node")),
                    "num_clients": int(node.get("clients", 0)),
                    "num_channels": int(node.get("topics", 0)),
                }
            )
    return {"nodes": nodes}


Method = Callable[[ApiContext, Any], Awaitable[dict[str, Any]]]

#: each method's request and handler, by name (`batch` is the router's own)
METHODS: dict[str, tuple[type[Struct], Method]] = {
    "publish": (req.Publish, publish),
    "broadcast": (req.Broadcast, broadcast),
    "presence": (req.Channel, presence),
    "presence_stats": (req.Channel, presence_stats),
    "history": (req.History, history),
    "subscribe": (req.Subscribe, users.subscribe),
    "unsubscribe": (req.Unsubscribe, users.unsubscribe),
    "disconnect": (req.Disconnect, users.disconnect),
    "refresh": (req.Refresh, users.refresh),
    "channels": (req.Channels, channels),
    "info": (req.Info, info),
}

#: Centrifugo's methods this gateway has no equivalent of: answered with 104 (method not found) and why
NOT_SUPPORTED = {
    "history_remove": "a ring is emptied only by deleting its topic (DELETE /api/topics/NAME)",
    "connections": "list connections with GET /api/clients",
    "revoke_token": "revoke tokens with POST /api/revocations",
    "invalidate_user_tokens": "revoke a user's tokens with POST /api/revocations",
    "update_user_status": "there is no user status",
    "get_user_status": "there is no user status",
    "delete_user_status": "there is no user status",
    "block_user": "there is no user block list; revoke the user's tokens with POST /api/revocations",
    "unblock_user": "there is no user block list",
    "device_register": "there are no push notifications",
    "device_update": "there are no push notifications",
    "device_remove": "there are no push notifications",
    "device_list": "there are no push notifications",
    "device_topic_list": "there are no push notifications",
    "device_topic_update": "there are no push notifications",
    "user_topic_list": "there are no push notifications",
    "user_topic_update": "there are no push notifications",
    "send_push_notification": "there are no push notifications",
    "update_push_status": "there are no push notifications",
    "cancel_push": "there are no push notifications",
    "rate_limit": "there is no rate limit API",
}


async def call(ctx: ApiContext, name: str, params: Any, budget: HistoryBudget | None = None) -> dict[str, Any]:
    """Run one method on its JSON parameters; `budget`: what the call's history answers may hold in all.
    Raises ApiError (104 for a method we do not have)."""
    if name in NOT_SUPPORTED:
        raise ApiError(METHOD_NOT_FOUND, f"{name} is not supported by this gateway: {NOT_SUPPORTED[name]}")
    if name not in METHODS:
        raise ApiError(METHOD_NOT_FOUND, f"no method {name[:64]!r}")
    kind, method = METHODS[name]
    if method is history:
        return await history(ctx, req.parse(params, req.History), budget)
    return await method(ctx, req.parse(params, kind))
