"""The cluster-wide listings of a Redis node (docs/cluster.md §5, "The admin API answers for the cluster"):
every topic in Redis for `GET /api/topics` and `GET /api/topics/NAME`, and every node's counters for
`GET /api/stats`, which this node writes to `P:node:ID` every second (the stats refresher, which also keeps
this node's private queues alive in Redis), with, while some node's stats stream has a viewer
(`P:stats:watched`), this node's client summary for that dashboard (`dash`, gateway/stats_feed.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from core import TopicConfig, TopicKind

from ..errors import BrokerUnavailable
from .topic_lines import config_from

if TYPE_CHECKING:
    from .node import RedisNode

log = logging.getLogger("gateway.broker")

#: The node's counters in Redis are refreshed this often and expire after STATS_TTL_S (a dead node leaves
#: the cluster listing within seconds).
STATS_PERIOD_S = 1.0
STATS_TTL_S = 5
#: `GET /api/topics` lists at most this many topics, the most recently published first.
ADMIN_LIST_MAX = 1000
#: a node missing from the node index this long is dropped from it by the next reader (its stats key has
#: long expired; generous, so clocks a little apart never drop a live node)
NODE_INDEX_STALE_S = 60


class ClusterInfo:
    """What the admin API shows of the whole cluster, read from (and, for this node's counters, written to)
    Redis by a `RedisBroker`."""

    def __init__(self, broker: "RedisNode") -> None:
        self.broker = broker
        self._queues_refreshed = time.monotonic()
        #: some node's stats stream had a viewer at the last refresh (`P:stats:watched` existed)
        self._watched = False

    def _info(self, name: str, meta: list[Any]) -> dict[str, Any] | None:
        epoch, top, settings = meta
        if epoch is None:
            return None
        topics = self.broker.events.topics
        config = config_from(settings) or topics.topic_config(name) or TopicConfig()
        local = topics.topic(name) if topics.has_topic(name) else None
        info: dict[str, Any] = {
            "name": name,
            "epoch": epoch.decode(),
            "subscribers": len(local.subs) if local is not None else 0,
            **config.as_dict(),
        }
        top = int(top or 0)
        if config.kind is TopicKind.SNAPSHOT:
            info["seq"] = top - 1
        elif config.kind is TopicKind.RING:
            info["begin"], info["end"] = max(0, top - config.capacity), top
            info["pending"] = 0
        return info

    async def topics(self) -> list[dict[str, Any]] | None:
        broker = self.broker
        try:
            listed: list[Any] = await broker.redis.zrevrange(broker.keys.topics, 0, ADMIN_LIST_MAX - 1)
            names = [n.decode() for n in listed]
            pipe = broker.redis.pipeline(transaction=False)
            for name in names:
                pipe.hmget(broker.keys.meta(name), "e", "n", "c")
            metas = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from None
        out = []
        for name, meta in zip(names, metas):
            info = self._info(name, meta)
            if info is not None:  # expired meanwhile
                out.append(info)
        return out

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        try:
            meta = await self.broker.redis.hmget(self.broker.keys.meta(topic), "e", "n", "c")
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from None
        return self._info(topic, meta)

    def _node_stats(self) -> dict[str, Any]:
        broker = self.broker
        events = broker.events
        return {
            "node": broker.node_id,
            "pid": os.getpid(),
            "core": events.topics.counters.as_dict(),
            "clients": events.client_count(),
            "topics": events.topics.topic_count,
            "attached": len(broker.lines),
        }

    async def _stats_loop(self) -> None:
        broker = self.broker
        while True:
            if broker.available:
                keys = broker.keys
                stats = self._node_stats()
                summary = broker.node_summary(self._watched)  # the stats feed's latest, while watched
                if summary is not None:
                    stats["dash"] = summary
                try:
                    pipe = broker.redis.pipeline(transaction=False)
                    pipe.set(keys.node(broker.node_id), orjson.dumps(stats), ex=STATS_TTL_S)
                    pipe.zadd(keys.node_index, {broker.node_id: time.time()})
                    pipe.expire(keys.node_index, NODE_INDEX_STALE_S)
                    pipe.exists(keys.stats_watched)
                    written = await pipe.execute()
                    self._watched = bool(written[-1])
                except (RedisError, OSError) as exc:
                    log.debug("broker: stats not written: %s", exc)
            elif self._watched:  # cut off: nobody can read a summary
                self._watched = False
                broker.node_summary(False)
                refreshed = time.monotonic()
                if refreshed - self._queues_refreshed > min(broker.ttl / 2, 600):
                    self._queues_refreshed = refreshed
                    try:
                        await broker.refresh_queues()
                    except (RedisError, OSError) as exc:
                        log.debug("broker: queues not refreshed: %s", exc)
            await asyncio.sleep(STATS_PERIOD_S)

    async def cluster_stats(self) -> dict[str, Any] | None:
        broker = self.broker
        keys = broker.keys
        try:
            # the node index, not SCAN: on Redis Cluster a SCAN sees one shard (the node keys share one slot)
            listed: list[Any] = await broker.redis.zrangebyscore(keys.node_index, time.time() - NODE_INDEX_STALE_S, "+inf")
            values = await broker.redis.mget([keys.node(n.decode()) for n in listed]) if listed else []
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from None
        nodes = [orjson.loads(v) for v in values if v is not None]
        totals: dict[str, int] = {}
        for node in nodes:
            for key, value in node["core"].items():
                totals[key] = totals.get(key, 0) + value
        return {"nodes": nodes, "clients": sum(n["clients"] for n in nodes), "core": totals}

    async def nodes(self, watch_s: float) -> list[dict[str, Any]]:
        """Every live node's stats (`P:node:ID`, with `dash` from the nodes that saw the cluster watched), for
        the stats stream; marks the cluster watched for `watch_s` seconds. Two round trips, O(nodes): the
        node index, then one MGET."""
        broker = self.broker
        if not broker.available:
            raise BrokerUnavailable(f"broker unreachable: {broker.last_error}")
        keys = broker.keys
        try:
            pipe = broker.redis.pipeline(transaction=False)
            pipe.set(keys.stats_watched, broker.node_id, ex=max(1, math.ceil(watch_s)))
            pipe.zremrangebyscore(keys.node_index, "-inf", time.time() - NODE_INDEX_STALE_S)
            pipe.zrange(keys.node_index, 0, -1)
            names: list[bytes] = (await pipe.execute())[-1]
            values = await broker.redis.mget([keys.node(n.decode()) for n in names]) if names else []
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from None
        return [orjson.loads(v) for v in values if v is not None]
