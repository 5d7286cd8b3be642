"""Admin REST API under /api, behind a bearer token. Errors are `{"error": {"code", "message"}}`."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core import QueueFull, RequestError, TopicKind, UnknownTopic

from . import close_codes, schema
from .bodies import read_body
from .config import ConfigError, topic_config
from .errors import BadJson, BadRequest, BrokerUnavailable, Disabled, Unauthorized, UnknownClient
from .http_errors import error_response
from .hub import Hub
from .openapi import OPENAPI

UNAUTHORIZED = Unauthorized("a valid `Authorization: Bearer <token>` header is required")
DISABLED = Disabled("the raw TCP broadcaster is disabled")


def _hub(request: Request) -> Hub:
    return request.app.state.hub


def _authorized(request: Request) -> bool:
    token = request.app.state.admin_token
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _json_body(request: Request) -> Any:
    body = await read_body(request, _hub(request).config.admin.max_body_bytes)
    if not body:
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadJson(f"not JSON: {exc}") from None


Endpoint = Callable[[Request], Awaitable[Response]]


def guarded(handler: Endpoint) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        if not _authorized(request):
            return error_response(UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except RequestError as exc:
            return error_response(exc)

    endpoint.__name__ = handler.__name__
    endpoint.__doc__ = handler.__doc__
    return endpoint


@guarded
async def list_topics(request: Request) -> Response:
    return JSONResponse({"topics": await _hub(request).topics_info()})


@guarded
async def create_topic(request: Request) -> Response:
    hub = _hub(request)
    body: schema.CreateTopic = schema.body(await _json_body(request), schema.CreateTopic)
    # Settings not given come from the rule the name matches (its permissions included), as on first use.
    rule = hub.engine.config.rule_for(body.name)
    try:
        config = topic_config({**(rule.as_dict() if rule is not None else {}), **body.settings()})
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    return JSONResponse(await hub.create_topic_async(body.name, config), status_code=201)


@guarded
async def get_topic(request: Request) -> Response:
    return JSONResponse(await _hub(request).topic_info(request.path_params["name"]))


@guarded
async def delete_topic(request: Request) -> Response:
    name = request.path_params["name"]
    return JSONResponse({"deleted": name, "subscribers_notified": await _hub(request).delete_topic_async(name)})


@guarded
async def publish(request: Request) -> Response:
    """Body: {"data": D} or {"messages": [D, ...]}, optional "client" (private topics) and "seq"."""
    hub = _hub(request)
    name = request.path_params["name"]
    body: schema.PublishBody = schema.body(await _json_body(request), schema.PublishBody)
    items = body.items()
    topic_config = hub.engine.topic_config(name) if hub.via_broker(name) else hub.resolve(name).config
    if topic_config is None:
        raise UnknownTopic(f"no topic {name!r} and no rule creates it")
    timeout = hub.config.admin.publish_timeout_s
    seqs: list[int] = []
    for data in items:
        try:
            if topic_config.kind is TopicKind.PRIVATE:
                result = await hub.publish_wait(name, data, owner=body.client, timeout=timeout, seq=body.seq)
            else:
                result = await hub.publish_async(name, data, seq=body.seq)
        except BrokerUnavailable as exc:
            return error_response(exc, {"Retry-After": "1"})
        except (QueueFull, asyncio.TimeoutError):
            return error_response(QueueFull(f"private queue still full after {timeout} s; "
                                            f"{len(seqs)} of {len(items)} published"), {"Retry-After": "1"})
        seqs.append(result.seq)
    return Response(msgspec.json.encode(schema.PublishReply(name, seqs)), media_type="application/json")


@guarded
async def list_clients(request: Request) -> Response:
    hub = _hub(request)
    clients = []
    for client in hub.engine.clients():
        conn = hub.conns.get(client.id)
        clients.append({
            "id": client.id,
            "user": conn.identity.user if conn is not None else None,
            "state": client.state.value,
            "subscriptions": sorted(client.subs),
            "direct_queued": len(client.direct),
            "active_handles": len(client.active),
            **(conn.describe() if conn is not None else {}),
        })
    return JSONResponse({"clients": clients})


@guarded
async def kick_client(request: Request) -> Response:
    client_id = request.path_params["client_id"]
    if not _hub(request).kick(client_id, close_codes.KICKED, "kicked by admin", "kicked"):
        return error_response(UnknownClient(f"no client {client_id[:128]!r}"))
    return JSONResponse({"kicked": client_id})


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
    counters = hub.engine.counters.as_dict()
    cycles = counters["cycles"] or 1
    return JSONResponse({
        "instance": hub.instance_id,
        "core": counters,
        "entries_per_cycle": counters["entries_emitted"] / cycles,
        "entries_per_batch": counters["entries_emitted"] / (counters["clients_served"] or 1),
        "clients": dict(hub.metrics.clients_by_transport),
        "write_blocked": len(hub.blocked),
        "topics": hub.engine.topic_count,
        "disconnects": {f"{t}:{r}": n for (t, r), n in hub.metrics.disconnects.items()},
        "ingest": {"records": hub.metrics.ingest_records, "errors": hub.metrics.ingest_errors},
        "raw": hub.raw.stats() if hub.raw is not None else None,
        "cluster": await hub.broker.cluster_stats(),
    })


async def openapi(request: Request) -> Response:
    return JSONResponse(OPENAPI)


routes = [
    Route("/openapi.json", openapi),
    Route("/topics", list_topics, methods=["GET"]),
    Route("/topics", create_topic, methods=["POST"]),
    Route("/topics/{name:path}/publish", publish, methods=["POST"]),
    Route("/topics/{name:path}", get_topic, methods=["GET"]),
    Route("/topics/{name:path}", delete_topic, methods=["DELETE"]),
    Route("/clients", list_clients, methods=["GET"]),
    Route("/clients/{client_id}", kick_client, methods=["DELETE"]),
    Route("/raw/receivers", raw_receivers, methods=["GET"]),
    Route("/raw/stats", raw_stats, methods=["GET"]),
    Route("/stats", stats, methods=["GET"]),
]


# -- read-only: which rule would create a topic (the Spark feed reads it before a topic exists) ------------


@guarded
async def get_rule(request: Request) -> Response:
    """The `[[topics.rules]]` entry a topic name is created by on first use: its pattern and settings."""
    name = request.path_params["name"]
    for rule in _hub(request).engine.config.rules:
        if rule.matches(name):
            return JSONResponse({"name": name, "pattern": rule.pattern, **rule.config.as_dict()})
    raise UnknownTopic(f"no topic rule matches {name[:256]!r}: create the topic with POST /api/topics")


routes.append(Route("/rules/{name:path}", get_rule, methods=["GET"]))


# -- the live stats stream: GET /api/stats/stream, read by the dashboard at /admin/ ----------------------

import heapq  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from operator import itemgetter  # noqa: E402
from typing import Hashable  # noqa: E402

from starlette.types import Receive, Scope, Send  # noqa: E402

from core.client import Client  # noqa: E402
from core.topics import Topic  # noqa: E402

from .errors import TooManyViewers  # noqa: E402

log = logging.getLogger("gateway.admin")

#: clients and topics listed in one snapshot, the busiest first; the rest are summed into `others` and the
#: totals. A dashboard shows a few dozen rows and a handful of chart lines: listing 10,000 clients every
#: second would cost encoding here and layout in the browser for rows nobody reads.
STREAM_TOP = 50
#: floor of `admin.stats_interval_s`: a sample walks every topic and client, so it must stay rare
MIN_STATS_INTERVAL_S = 0.1
#: topics or clients a sample reads between two yields to the loop: at ~0.5 µs each, ~1 ms, so a sample of
#: 100,000 topics (scheduler.max_topics) never holds up the fan-out for its whole ~50-100 ms
SAMPLE_CHUNK = 2048


def _lag(client: Client) -> int:
    """Messages waiting for a client in the gateway. Only handles in its active set hold any (caught-up ones
    are parked), so this costs O(its active handles), the pending work."""
    lag = 0
    for sub in client.active:
        end = getattr(sub.topic, "end", None)
        if isinstance(end, int):
            lag += max(0, end - sub.cursor)  # ring: seqs behind, lost ones included
        elif sub.queue is not None:
            lag += len(sub.queue)  # private: queued
        else:
            lag += 1  # snapshot: the latest value
    return lag


def _per_s(delta: float, dt: float | None) -> float | None:
    return round(delta / dt, 3) if dt else None


class StatsFeed:
    """One sampler for every viewer of the stats stream.

    While at least one viewer is connected, a task takes a snapshot every `admin.stats_interval_s`: one pass
    over the topics and one over the connections, O(topics + clients) per interval whatever the number of
    viewers, read in chunks of `SAMPLE_CHUNK` between which the loop runs (fan-out is never held up for a
    whole sample), plus, for the listed clients only, O(their active handles) for their lag. Rates are deltas
    between two samples computed here (topic positions, entries each connection was handed, core counters,
    histogram buckets), so the feed keeps the previous sample's numbers; when the last viewer leaves it
    stops the task and forgets them: an unwatched gateway pays nothing.
    """

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.interval = max(MIN_STATS_INTERVAL_S, hub.config.admin.stats_interval_s)
        self.max_viewers = hub.config.admin.stats_max_viewers
        self.viewers = 0
        #: the latest snapshot as one SSE event, and a future resolved when the next one replaces it
        self.latest: bytes | None = None
        self.next: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self._forget()

    def _forget(self) -> None:
        self._prev_at: float | None = None
        self._prev_topics: dict[Topic, int] = {}
        self._prev_clients: dict[Any, int] = {}
        self._prev_counters: dict[str, int] = {}
        self._prev_hist: dict[str, list[int]] = {}

    def join(self) -> bool:
        """Count a viewer in (False at `admin.stats_max_viewers`); the first one starts the sampler."""
        if self.viewers >= self.max_viewers:
            return False
        self.viewers += 1
        if self.task is None:
            loop = asyncio.get_running_loop()
            self.next = loop.create_future()
            self.task = loop.create_task(self._run(), name="admin-stats-feed")
        return True

    def leave(self) -> None:
        """Count a viewer out; the last one stops the sampler."""
        self.viewers -= 1
        if self.viewers == 0 and self.task is not None:
            self.task.cancel()
            self.task = None
            self.latest = self.next = None
            self._forget()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                snapshot = await self.sample(time.monotonic())
                self.latest = b"data: " + orjson.dumps(snapshot) + b"\n\n"
            except Exception:  # a bug here must not freeze the viewers: log it, try again next interval
                log.exception("stats sample failed")
            done, self.next = self.next, loop.create_future()
            if done is not None and not done.done():
                done.set_result(None)
            due = max(due + self.interval, loop.time())  # no burst of catch-up samples after a stall
            await asyncio.sleep(due - loop.time())

    async def sample(self, now: float) -> dict[str, Any]:
        hub = self.hub
        engine = hub.engine
        dt = now - self._prev_at if self._prev_at is not None else None
        self._prev_at = now

        # topics: O(topics), a few attribute reads each (the rate is a float for the listed ones only);
        # info() (O(1), private topics O(their queues)) for the listed ones. Keyed by the topic object: a
        # topic deleted and created again is another object, whose position starts over.
        prev_topics, positions = self._prev_topics, {}
        moved: list[tuple[int, Topic]] = []
        for count, topic in enumerate(engine.topics(), 1):
            if not count % SAMPLE_CHUNK:
                await asyncio.sleep(0)
            position = getattr(topic, "end", None)  # a ring's available end, else a snapshot's seq
            if position is None:
                position = getattr(topic, "seq", None)
            if position is None:  # private: a queue per user, no shared position
                moved.append((0, topic))
                continue
            positions[topic] = position
            before = prev_topics.get(topic)
            moved.append((position - before if before is not None else 0, topic))
        self._prev_topics = positions
        topics = [{**topic.info(), "rate": _per_s(delta, dt) if topic in prev_topics and topic in positions else None}
                  for delta, topic in heapq.nlargest(STREAM_TOP, moved, key=itemgetter(0))]

        # clients: O(clients), the same way; describe() and the lag only for the listed ones
        prev_clients, sent_now = self._prev_clients, {}
        deliveries: list[tuple[int, Hashable, Any]] = []
        for count, (client_id, conn) in enumerate(list(hub.conns.items()), 1):
            if not count % SAMPLE_CHUNK:
                await asyncio.sleep(0)
            sent = getattr(conn, "entries_sent", None)  # every transport that counts its deliveries
            if sent is None:
                deliveries.append((0, client_id, conn))
                continue
            sent_now[conn] = sent
            before = prev_clients.get(conn)
            deliveries.append((sent - before if before is not None else 0, client_id, conn))
        self._prev_clients = sent_now
        listed = heapq.nlargest(STREAM_TOP, deliveries, key=itemgetter(0))
        clients = []
        for delta, client_id, conn in listed:
            client = engine.client(client_id) if engine.has_client(client_id) else None
            clients.append({
                "id": client_id,
                "user": conn.identity.user,
                "state": client.state.value if client is not None else None,
                "subscription_count": len(client.subs) if client is not None else 0,
                "active_handles": len(client.active) if client is not None else 0,
                "direct_queued": len(client.direct) if client is not None else 0,
                "lag": _lag(client) if client is not None else 0,
                "rate": _per_s(delta, dt) if conn in prev_clients and conn in sent_now else None,
                **conn.describe(),
            })
        receiving = [delta / dt for delta, _, _ in deliveries if delta > 0] if dt else []
        total_rate = sum(receiving)
        listed_rate = sum(delta for delta, _, _ in listed) / dt if dt else 0.0

        counters = engine.counters.as_dict()
        prev_counters, self._prev_counters = self._prev_counters, counters

        def counter_rate(name: str) -> float | None:
            return _per_s(counters[name] - prev_counters[name], dt) if prev_counters else None

        histograms = {}
        for name, histogram in (("cycle_seconds", hub.metrics.cycle_seconds),
                                ("entries_per_batch", hub.metrics.entries_per_batch)):
            snap = histogram.snapshot()
            before_counts = self._prev_hist.get(name)
            snap["recent"] = ([c - b for c, b in zip(snap["counts"], before_counts)]
                              if before_counts is not None else None)
            self._prev_hist[name] = snap["counts"]
            histograms[name] = snap

        raw = hub.raw
        return {
            "time": time.time(),
            "interval_s": self.interval,
            "dt": round(dt, 4) if dt is not None else None,
            "instance": hub.instance_id,
            "viewers": self.viewers,
            "totals": {
                "topics": engine.topic_count,
                "clients": len(hub.conns),
                "clients_by_transport": dict(hub.metrics.clients_by_transport),
                "write_blocked": len(hub.blocked),
                "published_per_s": counter_rate("messages_published"),
                "delivered_per_s": counter_rate("messages_delivered"),
                "entries_per_s": counter_rate("entries_emitted"),
                "lost_per_s": counter_rate("messages_lost"),
                "cycles_per_s": counter_rate("cycles"),
                "client_delivery_per_s": round(total_rate, 3) if dt else None,
            },
            # Jain's index over the clients that received anything: 1.0 when they all got the same rate
            # (clients of different topics may differ for good reason: compare clients of one topic)
            "fairness": {
                "receiving": len(receiving),
                "min": round(min(receiving), 3) if receiving else None,
                "max": round(max(receiving), 3) if receiving else None,
                "jain": (round(total_rate ** 2 / (len(receiving) * sum(r * r for r in receiving)), 4)
                         if receiving else None),
            },
            "topics": topics,
            "clients": clients,
            "others": {"topics": len(moved) - len(topics), "clients": len(deliveries) - len(clients),
                       "rate": round(total_rate - listed_rate, 3) if dt else None},
            "histograms": histograms,
            "raw": {"stats": raw.stats(), "receivers": raw.receivers()} if raw is not None else None,
        }


def _feed(request: Request) -> StatsFeed:
    state = request.app.state
    feed: StatsFeed | None = getattr(state, "stats_feed", None)
    if feed is None:
        feed = state.stats_feed = StatsFeed(_hub(request))
    return feed


class SnapshotStream(Response):
    """The SSE answer of the stats stream: the latest snapshot, then each new one, until the viewer goes.

    A task waits for the viewer's `http.disconnect`, so a viewer that leaves is counted out at once, not at
    the next write; it is cancelled with the stream (nothing is left behind)."""

    media_type = "text/event-stream"

    def __init__(self, feed: StatsFeed) -> None:
        self.feed = feed
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        feed = self.feed
        if not feed.join():
            refused = TooManyViewers(f"{feed.max_viewers} stats streams are open (admin.stats_max_viewers)")
            await error_response(refused, {"Retry-After": "5"})(scope, receive, send)
            return
        gone = asyncio.get_running_loop().create_task(_disconnected(receive), name="admin-stats-viewer")
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            sent = None
            while not gone.done():
                latest = feed.latest
                if latest is not None and latest is not sent:
                    sent = latest
                    await send({"type": "http.response.body", "body": latest, "more_body": True})
                assert feed.next is not None  # set while a viewer is counted in
                await asyncio.wait((feed.next, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            feed.leave()


async def _disconnected(receive: Receive) -> None:
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the server's receive failed: the viewer is gone all the same
        pass


@guarded
async def stats_stream(request: Request) -> Response:
    """Server-sent events: one `data:` JSON snapshot every `admin.stats_interval_s` (docs/protocol.md)."""
    return SnapshotStream(_feed(request))


routes.append(Route("/stats/stream", stats_stream, methods=["GET"]))
