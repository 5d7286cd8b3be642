"""A node of the cluster: this process's Redis broker (docs/cluster.md §3-4), a facade over its parts.

Redis orders publishes (scripts.PUBLISH: seq, stream, channel in one step); this node feeds its engine what
comes on the channels of the topics it serves, with Redis's seqs, through the core's ordinary verbs plus
`create_topic(epoch=, start=)`, `skip` and `restart_topic`. The parts:

* the link (link.py, cluster_link.py): the connections to Redis for one topology (one Redis, the primary the
  sentinels name, or Redis Cluster's shards), losing Redis and reconnecting, resubscribing, handing each
  channel message here;
* the topic lines (topic_lines.py, with their SYNCING/LIVE machine in feeds.py): the shared topics this node
  serves, each fed from its stream and channel;
* publishing (publishing.py): the publishes waiting for Redis, their byte bound, the publisher task;
* private queues (private_queues.py), presence (presence_store.py), the control channel (control.py) and the
  cluster-wide listings with this node's stats refresher (cluster_info.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.exceptions import RedisError

from core import Published, TopicConfig, TopicKind

from ..auth.identity import ClientIdentity
from ..config import BrokerConfig
from ..presence import PresenceStore
from ..topic_budget import CreationBudget
from .base import BrokerEvents, BrokerUnreachable
from .cluster_info import ClusterInfo
from .cluster_link import ClusterLink
from .control import ControlChannel
from .feeds import Line
from .keys import Keys
from .link import Link, LinkHooks, SentinelLink, SingleLink
from .presence_store import RedisPresence
from .private_queues import PrivateQueues
from .publishing import Publisher
from .stopping import stop_tasks
from .topic_lines import TopicLines

log = logging.getLogger("gateway.broker")


class RedisBroker:
    clustered = True

    def __init__(
        self,
        config: BrokerConfig,
        events: BrokerEvents,
        creations: CreationBudget,
        instance_id: str,
        control: Callable[[dict[str, Any]], dict[str, Any]] = lambda command: {},
        node_summary: Callable[[bool], dict[str, Any] | None] = lambda watched: None,
    ) -> None:
        self.events = events
        self.keys = Keys(config.prefix, sharded=bool(config.cluster_addresses))
        self.ttl = max(1, math.ceil(config.history_ttl_s))
        self.connect_timeout = config.connect_timeout_s
        self.node_id = f"{instance_id}-{os.getpid()}"
        self.link = make_link(
            config,
            LinkHooks(
                message=self._on_message,
                lost=lambda: self.topic_lines.lost(),
                channels=self._channels,
                reconnected=self._reconnected,
                back=self._back,
                moved=self._moved,
                served=lambda: len(self.lines),
            ),
        )
        self.redis = self.link.redis
        self.shas = self.link.shas
        self.topic_lines = TopicLines(self.link, self.keys, events, creations, self.ttl, config.max_topics)
        self.lines: Mapping[str, Line] = self.topic_lines.lines
        self.publisher = Publisher(self.link, self.keys, self.topic_lines, config.max_pending_bytes)
        self._tasks: list[asyncio.Task[None]] = []
        #: private queues held in Redis (private_queues.py, docs/cluster.md §8)
        self.queues = PrivateQueues(self)
        #: the cluster-wide listings and this node's stats refresher (cluster_info.py)
        self.cluster = ClusterInfo(self)
        #: presence members in Redis, this node's heartbeat, join/leave announcements (presence_store.py)
        self.presence_store = RedisPresence(self)
        self.topic_lines.presence = self.presence_store
        self.presence: PresenceStore = self.presence_store
        #: private queues live in Redis, so the engine reports commits for Redis to acknowledge (§8)
        events.attach_broker(self.presence, self.committed)
        #: the operators' commands on every node (control.py); `control` runs one on this node
        self.control_handler = control
        self.controls = ControlChannel(self)
        #: this node's summary for the dashboards of the cluster (set by the stats feed, gateway/stats_feed.py)
        self.node_summary = node_summary

    # -- the link's state, for the helpers (node.py) and readiness --------------------------------------

    @property
    def available(self) -> bool:
        return self.link.available

    @property
    def last_error(self) -> str:
        return self.link.last_error

    @property
    def healthy(self) -> bool:
        """Whether /readyz may say ready: Redis is connected and answered the last PING in time."""
        return self.link.healthy

    @property
    def congested(self) -> bool:
        return self.publisher.congested

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.link.connect(self.connect_timeout)
        log.info(
            "broker %s: node %s",
            self.link.target,
            self.node_id,
            extra={"broker": self.link.target, "state": "connected", "node": self.node_id},
        )
        await self.presence_store.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            *self.link.run(),
            self.publisher.run(),
            *self.topic_lines.directory.run(),
            loop.create_task(self.cluster._stats_loop(), name="broker-stats"),
        ]
        try:
            await self.link.subscribe_channels([self.keys.control])
            await self.controls.load_revocations()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise BrokerUnreachable(f"broker {self.link.target}: control channel: {exc}") from None

    async def stop(self) -> None:
        self.queues.stop()
        self.controls.stop()
        self.topic_lines.stop()
        await stop_tasks(self._tasks)
        self.publisher.stop()
        await self.presence_store.stop()
        if self.available:
            try:
                await self.redis.delete(self.keys.node(self.node_id))
            except (RedisError, OSError):
                pass
        await self.link.close()

    def _on_message(self, channel: str, payload: bytes) -> None:
        if not (self.queues.on_message(channel, payload) or self.controls.on_message(channel, payload)):
            self.topic_lines.on_message(channel, payload)

    def _channels(self) -> list[str]:
        return [self.keys.control, *self.topic_lines.channels(), *self.queues.channels()]

    def _moved(self, channel: str) -> None:
        """Redis Cluster: `channel` followed its slot to another primary; read what it may have missed."""
        held = self.queues.by_channel.get(channel)
        if held is not None and held.epoch is not None:
            self.queues.pull(held)
        line = self.lines.get(self.keys.topic_of(channel))
        if line is not None and self.keys.channel(line.name) == channel:
            self.topic_lines.resync(line)

    async def _reconnected(self) -> None:
        """Before publishes resume: a Redis behind this node (rewind.py, private_queues.py) gives no seq twice."""
        await self.topic_lines.rewinder.check(self.lines.values())
        await self.queues.check_behind()

    def _back(self) -> None:
        """Publishes resumed: resynchronise what lives in Redis (the link's `back` line tells how many topics)."""
        self.publisher.wake_accepting()
        self.topic_lines.back()
        self.queues.resync()
        self.presence_store.resync()
        self.controls.resync()

    # -- the seam ----------------------------------------------------------------------------------------

    def when_accepting(self) -> asyncio.Future[None]:
        return self.publisher.when_accepting()

    def _private(self, topic: str) -> bool:
        """Whether `topic` is private: its queues live in Redis lists (private_queues.py), not in streams."""
        config = self.events.topics.topic_config(topic)
        return config is not None and config.kind is TopicKind.PRIVATE

    def publish_nowait(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published | None:
        return None  # every topic lives in Redis: its seq comes from the script

    def publish(
        self,
        topic: str,
        data: Any,
        *,
        seq: int | None = None,
        owner: Hashable = None,
        creator: ClientIdentity | None = None,
        deadline: float | None = None,
    ) -> asyncio.Future[Published]:
        if self._private(topic):  # a full queue holds the publish back until it has room (or `deadline`)
            seq_future = self.queues.push(topic, owner, data, seq, deadline)
        else:
            seq_future = self.publisher.publish(topic, data, seq, creator)
        result: asyncio.Future[Published] = asyncio.get_running_loop().create_future()

        def landed(done: asyncio.Future[int]) -> None:
            exc = done.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(Published(topic, done.result()))

        seq_future.add_done_callback(landed)
        return result

    def creates_here(self, topic: str) -> bool:
        # shared topics are created in Redis (which charges the creator's budget when it did)
        return self._private(topic) and not self.events.topics.has_topic(topic)

    def subscribe(
        self,
        client_id: str,
        topic: str,
        *,
        since: tuple[str, int] | None,
        request_id: Any,
        creator: ClientIdentity,
        ack: bool = False,
        delta: bool | None = None,
    ) -> None:
        if self._private(topic):
            self.queues.subscribe(client_id, topic, request_id, ack)
        else:
            self.topic_lines.subscribe(client_id, topic, since, request_id, creator, delta)

    def left(self, topic: str, owner: Hashable, *, unsubscribed: bool) -> None:
        if not self._private(topic):
            self.topic_lines.release(topic)
        elif unsubscribed:
            self.queues.unsubscribed(topic, owner)
        else:
            self.queues.released(topic, owner)

    def committed(self, reports: list[tuple[str, Hashable, int]]) -> None:
        self.queues.committed(reports)

    async def create(self, topic: str, config: TopicConfig) -> dict[str, Any]:
        topics = self.events.topics
        if config.kind is TopicKind.PRIVATE:  # its queues are made in Redis when their users subscribe
            return self.events.create_topic(topic, config)
        await self.topic_lines.create(topic, config)
        info = topics.topic(topic).info() if topics.has_topic(topic) else await self.topic_info(topic)
        assert info is not None
        return dict(info)

    async def delete(self, topic: str) -> int:
        topics = self.events.topics
        if self._private(topic):
            return self.events.deleted(topic)
        subscribers = len(topics.topic(topic).subs) if topics.has_topic(topic) else 0
        await self.topic_lines.delete(topic)
        return subscribers

    # -- cluster-wide listings (admin API): cluster_info.py ---------------------------------------------

    # -- cluster-wide listings (admin API): cluster_info.py ---------------------------------------------

    async def topics(self) -> list[dict[str, Any]] | None:
        return await self.cluster.topics()

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        return await self.cluster.topic_info(topic)

    async def cluster_stats(self) -> dict[str, Any] | None:
        return await self.cluster.cluster_stats()

    async def cluster_nodes(self, watch_s: float) -> list[dict[str, Any]] | None:
        return await self.cluster.nodes(watch_s)

    async def control(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        return await self.controls.control(command)

    async def refresh_queues(self) -> None:
        await self.queues.refresh()

    def collect(self) -> Iterator[Metric]:
        publisher = self.publisher
        yield GaugeMetricFamily(
            "fanout_broker_pending_bytes",
            "bytes of publishes waiting for Redis (bounded by broker.max_pending_bytes)",
            value=publisher.pending_bytes,
        )
        yield CounterMetricFamily(
            "fanout_broker_backlog_refused",
            "publishes refused (broker_unavailable) because broker.max_pending_bytes wait for Redis",
            value=publisher.backlog_refused,
        )
        yield CounterMetricFamily(
            "fanout_broker_reconnect_failures", "attempts to reconnect to Redis that failed", value=self.link.reconnect_failures
        )
        yield CounterMetricFamily(
            "fanout_broker_rewinds",
            "topics that started a new epoch because Redis was"
            " behind this node (restored from an older state, a replica that lagged)",
            value=self.topic_lines.rewinder.rewinds,
        )


def make_link(config: BrokerConfig, hooks: LinkHooks) -> Link:
    """The link of the configured topology: Redis Cluster, Redis behind Sentinel, or one Redis."""
    if config.cluster_addresses:
        return ClusterLink(config, hooks)
    if config.sentinel_addresses:
        return SentinelLink(config, hooks)
    return SingleLink(config, hooks)
