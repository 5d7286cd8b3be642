"""The live stats stream (`GET /api/stats/stream`, read by the dashboard at /admin/): one sampler shared by
every viewer, running only while one is connected, and the server-sent-events answer of each viewer.

With a broker, the stream shows the whole cluster (`cluster`): a node with a viewer marks the cluster watched
in Redis; while it is, every node runs its own sampler and its stats refresher (broker/cluster_info.py) puts
a compact summary of the latest sample (`node_summary`: its totals, rates, fairness sums and its
`NODE_TOP` busiest clients) into its `P:node:ID` key, refreshed every second; the viewer's sampler reads
every node's key once per interval and merges them."""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import time
from collections.abc import Callable
from operator import itemgetter
from typing import Any, Hashable, NamedTuple, Protocol

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core.client import Client
from core.topics import Topic

from .broker.base import Broker
from .clients import ClientRegistry
from .config import GatewayConfig
from .edge.http_errors import error_response
from .errors import BrokerUnavailable, TooManyViewers
from .scheduler import Scheduler
from .topic_view import TopicView
from .transports.rawtcp import RawBroadcastServer
from .transports.ws_counters import ws_counters

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
#: clients a node lists in its summary for the cluster's dashboards (the cluster's busiest STREAM_TOP are
#: among the union of every node's busiest STREAM_TOP): at ~300 bytes each, ~15 KB per node per second
NODE_TOP = STREAM_TOP


def _lag(client: Client, *, unread: bool = False) -> int:
    """Messages waiting for a client in the gateway. Only handles in its active set hold any (caught-up ones
    are parked), so this costs O(its active handles), the pending work. `unread`: not counting entries of
    private queues already handed out and not yet committed or acknowledged."""
    lag = 0
    for sub in client.active:
        end = getattr(sub.topic, "end", None)
        if isinstance(end, int):
            lag += max(0, end - sub.cursor)  # ring: seqs behind, lost ones included
        elif sub.queue is not None:
            lag += len(sub.queue) - sub.peeked if unread else len(sub.queue)  # private: queued
        else:
            lag += 1  # snapshot: the latest value
    return lag


def delivery_share(delivered: int, waiting: int) -> float | None:
    """A client's share of what it asked for in a stats window: the entries it was handed during the window
    over those plus the ones still waiting for it at the window's end (= what waited at the start plus what
    arrived for it, direct entries included, less any lost on the way). 1.0 for a client that is caught up,
    0.0 for one that took nothing while entries waited; None when it asked for nothing (left out)."""
    owed = delivered + waiting
    return delivered / owed if owed > 0 else None


def jain(count: int, total: float, total_sq: float) -> float | None:
    """Jain's index (sum x)^2 / (n * sum x^2) from n, sum x and sum x^2 (so a cluster's is exact from its
    nodes' sums): 1.0 when all are equal (all 0 included), 1/n when one has everything; None for n = 0."""
    if not count:
        return None
    return round(total * total / (count * total_sq), 4) if total_sq else 1.0


def _ratio(counters: dict[str, int], prev: dict[str, int]) -> float | None:
    """Wire bytes over payload bytes of the WebSocket data frames sent since the last sample (since start on
    the first), None when none were sent."""
    payload = counters["ws_payload_bytes"] - prev.get("ws_payload_bytes", 0)
    return round((counters["ws_wire_bytes"] - prev.get("ws_wire_bytes", 0)) / payload, 3) if payload else None


def _per_s(delta: float, dt: float | None) -> float | None:
    return round(delta / dt, 3) if dt else None


class _ClientsSample(NamedTuple):
    """One pass over the connections (`StatsFeed._sample_clients`)."""

    #: the listed clients' rows, the busiest first
    rows: list[dict[str, Any]]
    #: connections seen
    seen: int
    #: the delivery_share of each client that asked for something in the window
    shares: list[float]
    #: the entries per second of each client that received any
    receiving: list[float]
    total_rate: float
    listed_rate: float


def _position(topic: Topic) -> int | None:
    """A ring's available end, else a snapshot's seq; None for a private topic (a queue per user)."""
    position: int | None = getattr(topic, "end", None)
    return position if position is not None else getattr(topic, "seq", None)


def _waiting(view: TopicView, client_id: Hashable) -> int:
    """What still waits for a client at the window's end (its lag, unread, and its direct queue)."""
    client = view.client(client_id) if view.has_client(client_id) else None
    if client is not None and (client.active or client.direct):
        return _lag(client, unread=True) + client.queued()
    return 0


def _client_row(view: TopicView, client_id: Hashable, conn: Any, rate: float | None) -> dict[str, Any]:
    client = view.client(client_id) if view.has_client(client_id) else None
    return {
        "id": client_id,
        "user": conn.identity.user,
        "state": client.state.value if client is not None else None,
        "subscription_count": len(client.subs) if client is not None else 0,
        "active_handles": len(client.active) if client is not None else 0,
        "direct_queued": client.queued() if client is not None else 0,
        "lag": _lag(client) if client is not None else 0,
        "rate": rate,
        **conn.describe(),
    }


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def _fairness(clients: _ClientsSample) -> dict[str, Any]:
    shares, receiving = clients.shares, clients.receiving
    return {
        "clients": len(shares),
        "jain": jain(len(shares), sum(shares), sum(x * x for x in shares)),
        "share_min": round(min(shares), 4) if shares else None,
        "receiving": len(receiving),
        "min": round(min(receiving), 3) if receiving else None,
        "max": round(max(receiving), 3) if receiving else None,
    }


def _node_summary(now_s: float, dt: float | None, totals: dict[str, Any], clients: _ClientsSample) -> dict[str, Any]:
    """This node's compact summary of a sample, for the other nodes' streams (`StatsFeed.node_summary`)."""
    shares, receiving = clients.shares, clients.receiving
    return {
        "time": now_s,
        "dt": _rounded(dt, 4),
        "totals": totals,
        "fairness": {
            "clients": len(shares),
            "share_sum": sum(shares),
            "share_sq": sum(x * x for x in shares),
            "share_min": min(shares) if shares else None,
            "receiving": len(receiving),
            "min": min(receiving) if receiving else None,
            "max": max(receiving) if receiving else None,
        },
        "clients": clients.rows[:NODE_TOP],
    }


class StatsSource(Protocol):
    """What the feed samples: the hub's parts (the hub makes the feed, gateway/hub.py)."""

    config: GatewayConfig
    instance_id: str
    topics: TopicView
    clients: ClientRegistry
    scheduler: Scheduler
    broker: Broker
    raw: RawBroadcastServer | None
    #: called at shutdown: every stream ends
    closing_hooks: list[Callable[[], None]]


class StatsFeed:
    """One sampler for every viewer of the stats stream.

    While at least one viewer is connected, a task takes a snapshot every `admin.stats_interval_s`: one pass
    over the topics and one over the connections, O(topics + clients) per interval whatever the number of
    viewers, read in chunks of `SAMPLE_CHUNK` between which the loop runs (fan-out is never held up for a
    whole sample), plus O(active handles) for the clients' lags (the listed ones' and, for the fairness
    index, every client's that has work waiting: caught-up clients have no active handle). Rates are deltas
    between two samples computed here (topic positions, entries each connection was handed, core counters,
    histogram buckets), so the feed keeps the previous sample's numbers; when the last viewer leaves it
    stops the task and forgets them: an unwatched gateway pays nothing.
    """

    def __init__(self, hub: StatsSource) -> None:
        self.hub = hub
        self.interval = max(MIN_STATS_INTERVAL_S, hub.config.admin.stats_interval_s)
        self.max_viewers = hub.config.admin.stats_max_viewers
        self.viewers = 0
        #: the latest snapshot as one SSE event, and a future resolved when the next one replaces it
        self.latest: bytes | None = None
        self.next: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        #: the server is shutting down: every stream ends
        self.closed = False
        #: another node's stream has a viewer (the stats refresher says so every second): sample for it
        self.remote = False
        #: this node's compact summary of its latest sample, for the other nodes' streams
        self.summary: dict[str, Any] | None = None
        hub.closing_hooks.append(self.close)
        self._forget()

    def close(self) -> None:
        self.closed = True
        if self.next is not None and not self.next.done():
            self.next.set_result(None)
        self.remote = False  # a sampler kept for another node's stream only stops now (viewers' at their end)
        self._stop_unwatched()

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
        self._start()
        return True

    def leave(self) -> None:
        """Count a viewer out; the last one stops the sampler (unless another node's stream is watching)."""
        self.viewers -= 1
        if self.viewers == 0:
            self.latest = None  # sampled for another node's stream only, no longer encoded: never stale
        self._stop_unwatched()

    def node_summary(self, watched: bool) -> dict[str, Any] | None:
        """The broker's stats refresher, every second: whether some node's stream has a viewer. While one
        has, the sampler runs here too and this gives its latest summary (None before the first sample)."""
        if self.closed:
            return None
        if watched != self.remote:
            self.remote = watched
            if watched:
                self._start()
            else:
                self._stop_unwatched()
        return self.summary if watched else None

    def _start(self) -> None:
        if self.task is None:
            loop = asyncio.get_running_loop()
            self.next = loop.create_future()
            self.task = loop.create_task(self._run(), name="admin-stats-feed")

    def _stop_unwatched(self) -> None:
        if self.viewers == 0 and not self.remote and self.task is not None:
            self.task.cancel()
            self.task = None
            self.latest = self.next = None
            self.summary = None
            self._forget()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                snapshot = await self.sample(time.monotonic())
                if self.viewers:  # else sampled for another node's stream only (its summary)
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
        dt = now - self._prev_at if self._prev_at is not None else None
        self._prev_at = now
        topics, topics_seen = await self._sample_topics(dt)
        clients = await self._sample_clients(dt)
        counters, prev_counters = self._sample_counters()
        histograms = self._sample_histograms()
        node_id = hub.broker.node_id if hub.broker.clustered else None
        if node_id:  # with a broker: which node each listed client is on
            for row in clients.rows:
                row["node"] = node_id
        totals = self._totals(counters, prev_counters, dt, clients)
        now_s = time.time()
        if node_id:
            self.summary = _node_summary(now_s, dt, totals, clients)
        cluster = await self._cluster(now_s) if node_id and self.viewers else None
        raw = hub.raw
        return {
            "time": now_s,
            "interval_s": self.interval,
            "dt": _rounded(dt, 4),
            "instance": hub.instance_id,
            "node": node_id,
            "viewers": self.viewers,
            "totals": totals,
            # Jain's index of the clients' shares of what they asked for (delivery_share), not of their raw
            # rates (clients of busier topics get more, rightly): 1.0 when every client is caught up; beside
            # it the spread of the raw rates of the clients that received anything
            "fairness": _fairness(clients),
            "topics": topics,
            "clients": clients.rows,
            "others": {
                "topics": topics_seen - len(topics),
                "clients": clients.seen - len(clients.rows),
                "rate": round(clients.total_rate - clients.listed_rate, 3) if dt else None,
            },
            "histograms": histograms,
            "raw": {"stats": raw.stats(), "receivers": raw.receivers()} if raw is not None else None,
            "cluster": cluster,
        }

    async def _sample_topics(self, dt: float | None) -> tuple[list[dict[str, Any]], int]:
        """The STREAM_TOP topics that moved most since the last sample, and how many topics there are.

        O(topics), a few attribute reads each (the rate is a float for the listed ones only); info() (O(1),
        private topics O(their queues)) for the listed ones. Keyed by the topic object: a topic deleted and
        created again is another object, whose position starts over."""
        prev_topics, positions = self._prev_topics, {}
        moved: list[tuple[int, Topic]] = []
        for count, topic in enumerate(self.hub.topics.topics(), 1):
            if not count % SAMPLE_CHUNK:
                await asyncio.sleep(0)
            position = _position(topic)
            if position is None:  # private: a queue per user, no shared position
                moved.append((0, topic))
                continue
            positions[topic] = position
            before = prev_topics.get(topic)
            moved.append((position - before if before is not None else 0, topic))
        self._prev_topics = positions
        listed = heapq.nlargest(STREAM_TOP, moved, key=itemgetter(0))
        return [
            {**topic.info(), "rate": _per_s(delta, dt) if topic in prev_topics and topic in positions else None}
            for delta, topic in listed
        ], len(moved)

    async def _sample_clients(self, dt: float | None) -> _ClientsSample:
        """The STREAM_TOP clients handed most since the last sample, and the fairness index's shares.

        O(clients), the same way; describe() only for the listed ones, the lag for them and for the
        fairness index (O(active handles): none for a caught-up client)."""
        view = self.hub.topics
        prev_clients, sent_now = self._prev_clients, {}
        deliveries: list[tuple[int, Hashable, Any]] = []
        # the fairness index: each client's delivery_share over the window, for the clients that asked for
        # something in it, in this same pass (once per interval)
        shares: list[float] = []
        for count, (client_id, conn) in enumerate(list(self.hub.clients.conns.items()), 1):
            if not count % SAMPLE_CHUNK:
                await asyncio.sleep(0)
            sent = getattr(conn, "entries_sent", None)  # every transport that counts its deliveries
            if sent is None:
                deliveries.append((0, client_id, conn))
                continue
            sent_now[conn] = sent
            before = prev_clients.get(conn)
            delta = sent - before if before is not None else 0
            deliveries.append((delta, client_id, conn))
            if before is None:  # connected during the window: what it was handed in it is not known
                continue
            share = delivery_share(delta, _waiting(view, client_id))
            if share is not None:
                shares.append(share)
        self._prev_clients = sent_now
        listed = heapq.nlargest(STREAM_TOP, deliveries, key=itemgetter(0))
        rows = [
            _client_row(view, client_id, conn, _per_s(delta, dt) if conn in prev_clients and conn in sent_now else None)
            for delta, client_id, conn in listed
        ]
        receiving = [delta / dt for delta, _, _ in deliveries if delta > 0] if dt else []
        listed_rate = sum(delta for delta, _, _ in listed) / dt if dt else 0.0
        return _ClientsSample(rows, len(deliveries), shares, receiving, sum(receiving), listed_rate)

    def _sample_counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """The core's counters with the WebSocket's bytes (gateway/transports/ws_counters.py) beside them, and
        the previous sample's (empty on the first)."""
        counters = {
            **self.hub.topics.counters.as_dict(),
            "ws_wire_bytes": ws_counters.wire_bytes,
            "ws_payload_bytes": ws_counters.payload_bytes,
        }
        prev_counters, self._prev_counters = self._prev_counters, counters
        return counters, prev_counters

    def _sample_histograms(self) -> dict[str, dict[str, Any]]:
        """The scheduler's histograms, each with its buckets' counts since the last sample (`recent`)."""
        histograms = {}
        for name, histogram in (
            ("cycle_seconds", self.hub.scheduler.cycle_seconds),
            ("entries_per_batch", self.hub.scheduler.entries_per_batch),
        ):
            snap = histogram.snapshot()
            before_counts = self._prev_hist.get(name)
            snap["recent"] = [c - b for c, b in zip(snap["counts"], before_counts)] if before_counts is not None else None
            self._prev_hist[name] = snap["counts"]
            histograms[name] = snap
        return histograms

    def _totals(
        self, counters: dict[str, int], prev_counters: dict[str, int], dt: float | None, clients: _ClientsSample
    ) -> dict[str, Any]:
        hub = self.hub

        def counter_rate(name: str) -> float | None:
            return _per_s(counters[name] - prev_counters[name], dt) if prev_counters else None

        return {
            "topics": hub.topics.topic_count,
            "clients": len(hub.clients.conns),
            "clients_by_transport": dict(hub.clients.by_transport),
            "write_blocked": len(hub.scheduler.blocked),
            "published_per_s": counter_rate("messages_published"),
            "delivered_per_s": counter_rate("messages_delivered"),
            "entries_per_s": counter_rate("entries_emitted"),
            "lost_per_s": counter_rate("messages_lost"),
            "cycles_per_s": counter_rate("cycles"),
            "client_delivery_per_s": round(clients.total_rate, 3) if dt else None,
            # WebSocket data frames: bytes out on the wire per second, and wire / payload bytes in the interval
            # (below 1 with permessage-deflate; None when nothing was sent)
            "ws_bytes_per_s": counter_rate("ws_wire_bytes"),
            "ws_wire_ratio": _ratio(counters, prev_counters),
            # since start: what a first sample (no rates yet) can already show
            "counters": counters,
        }

    async def _cluster(self, now: float) -> dict[str, Any]:
        """Every node's summary merged: this node's from the sample just taken, the others' from Redis (one
        read of the node index and one MGET, O(nodes x NODE_TOP)); the cluster stays watched meanwhile."""
        hub = self.hub
        own = hub.broker.node_id
        error: str | None = None
        try:
            stored = await hub.broker.cluster_nodes(max(3.0, 2 * self.interval + 1))
        except BrokerUnavailable as exc:  # this node's part still shows
            stored, error = [], exc.message
        nodes: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        share_n, share_sum, share_sq, share_min = 0, 0.0, 0.0, []
        receiving, fair_min, fair_max = 0, [], []
        by_transport: dict[str, int] = {}
        clients = blocked = 0
        counters: dict[str, int] = {}
        delivered: float | None = None
        client_rate: float | None = None
        for entry in [{"node": own, "pid": os.getpid(), "dash": self.summary}] + [
            n for n in stored or () if n.get("node") != own
        ]:
            dash = entry.get("dash")
            node_id = entry.get("node")
            since_start = dash["totals"].get("counters") if isinstance(dash, dict) else entry.get("core")
            for name, value in (since_start or {}).items():  # (an older node's summary has none)
                counters[name] = counters.get(name, 0) + value
            if isinstance(dash, dict):
                totals = dash["totals"]
                fair = dash["fairness"]
                node = {
                    "node": node_id,
                    "pid": entry.get("pid"),
                    "age_s": round(max(0.0, now - dash["time"]), 3),
                    "listed": len(dash["clients"]),
                    **{
                        k: totals[k]
                        for k in (
                            "clients",
                            "topics",
                            "write_blocked",
                            "published_per_s",
                            "delivered_per_s",
                            "lost_per_s",
                            "client_delivery_per_s",
                        )
                    },
                }
                for k, v in totals["clients_by_transport"].items():
                    by_transport[k] = by_transport.get(k, 0) + v
                blocked += totals["write_blocked"]
                if totals["delivered_per_s"] is not None:
                    delivered = (delivered or 0.0) + totals["delivered_per_s"]
                if totals["client_delivery_per_s"] is not None:
                    client_rate = (client_rate or 0.0) + totals["client_delivery_per_s"]
                if fair.get("clients"):  # (an older node's summary has no shares: left out)
                    share_n += fair["clients"]
                    share_sum += fair["share_sum"]
                    share_sq += fair["share_sq"]
                    share_min.append(fair["share_min"])
                if fair["receiving"]:
                    receiving += fair["receiving"]
                    fair_min.append(fair["min"])
                    fair_max.append(fair["max"])
                for row in dash["clients"]:
                    rows.append({**row, "node": node_id})
            else:  # no summary yet (its refresher has not seen the cluster watched), or an older version
                node = {
                    "node": node_id,
                    "pid": entry.get("pid"),
                    "age_s": None,
                    "listed": None,
                    "clients": entry.get("clients", 0),
                    "topics": entry.get("topics"),
                    "write_blocked": None,
                    "published_per_s": None,
                    "delivered_per_s": None,
                    "lost_per_s": None,
                    "client_delivery_per_s": None,
                }
            clients += node["clients"] or 0
            nodes.append(node)
        listed = heapq.nlargest(STREAM_TOP, rows, key=lambda row: row.get("rate") or 0.0)
        shown_rate = sum(row.get("rate") or 0.0 for row in listed)
        return {
            "nodes": sorted(nodes, key=lambda n: str(n["node"])),
            "error": error,
            "totals": {
                "nodes": len(nodes),
                "clients": clients,
                "clients_by_transport": by_transport,
                "write_blocked": blocked,
                "delivered_per_s": round(delivered, 3) if delivered is not None else None,
                "client_delivery_per_s": round(client_rate, 3) if client_rate is not None else None,
                "counters": counters,
            },
            "fairness": {
                "clients": share_n,
                "jain": jain(share_n, share_sum, share_sq),
                "share_min": round(min(share_min), 4) if share_min else None,
                "receiving": receiving,
                "min": round(min(fair_min), 3) if fair_min else None,
                "max": round(max(fair_max), 3) if fair_max else None,
            },
            "clients": listed,
            "others": {
                "clients": clients - len(listed),
                "rate": round(client_rate - shown_rate, 3) if client_rate is not None else None,
            },
        }


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
            while not gone.done() and not feed.closed:
                latest = feed.latest
                if latest is not None and latest is not sent:
                    sent = latest
                    await send({"type": "http.response.body", "body": latest, "more_body": True})
                assert feed.next is not None  # set while a viewer is counted in
                await asyncio.wait((feed.next, gone), return_when=asyncio.FIRST_COMPLETED)
            if feed.closed and not gone.done():  # shutting down: end the response, the viewer reconnects
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            feed.leave()


async def _disconnected(receive: Receive) -> None:
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the server's receive failed: the viewer is gone all the same
        pass
