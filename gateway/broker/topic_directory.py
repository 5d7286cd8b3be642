"""The cluster-wide topic listing and bound on Redis Cluster (docs/cluster.md §10, "Keys").

On one Redis the PUBLISH and TOUCH scripts keep `P:topics` (name -> last publish) and check `broker.max_topics`
against it atomically. On Redis Cluster a script may only touch its topic's slot, and one key written by every
publish would put every publish on one shard. So the nodes keep the listing instead: each node notes the
topics Redis accepted a publish of (or created) from it and, once a second, adds them to `P:{cluster wide}:topics`
with the time, drops the names older than `broker.history_ttl_s` (their keys expired) and reads how many
remain. While that count is at the bound, the node's scripts refuse to create topics (`max` -1, scripts._ROOM).

Limits: the bound is checked against a count at most one period old, so the nodes together may create the
topics of one period past it; the listing's times are those of the node's last flush (within a second of
the publish); a topic created by a node that died before its flush is listed at its next publish.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from .keys import Keys
from .link import Link

log = logging.getLogger("gateway.broker")

#: How often a node writes its noted topics and rereads the count.
FLUSH_PERIOD_S = 1.0
#: Topics noted and not yet written at most (Redis away for long): beyond, names wait for their next publish.
NOTED_MAX = 100_000


class TopicDirectory:
    def __init__(self, link: Link, keys: Keys, ttl: int, max_topics: int) -> None:
        self.link = link
        self.keys = keys
        self.ttl = ttl
        self.max_topics = max_topics
        self.noted: set[str] = set()
        self.removed: set[str] = set()
        #: the count at the last flush met broker.max_topics: creations are refused
        self.full = False

    def note(self, topic: str) -> None:
        """Redis accepted a publish of `topic` from this node, or created it."""
        if self.link.sharded and len(self.noted) < NOTED_MAX:
            self.noted.add(topic)
            self.removed.discard(topic)

    def forget(self, topic: str) -> None:
        """An operator deleted `topic`."""
        if self.link.sharded and len(self.removed) < NOTED_MAX:
            self.noted.discard(topic)
            self.removed.add(topic)

    def run(self) -> list[asyncio.Task[None]]:
        if not self.link.sharded:
            return []
        return [asyncio.get_running_loop().create_task(self._loop(), name="broker-topic-directory")]

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_PERIOD_S)
            if self.link.available:
                try:
                    await self.flush()
                except (RedisError, OSError, asyncio.TimeoutError) as exc:
                    log.debug("broker: topic listing not written: %s", exc)

    async def flush(self) -> None:
        noted, removed = self.noted, self.removed
        self.noted, self.removed = set(), set()
        now = time.time()
        key = self.keys.topics
        pipe = self.link.redis.pipeline(transaction=False)
        if noted:
            pipe.zadd(key, dict.fromkeys(noted, now))
        if removed:
            pipe.zrem(key, *removed)
        pipe.zremrangebyscore(key, "-inf", now - self.ttl)
        pipe.zcard(key)
        try:
            count = (await pipe.execute())[-1]
        except BaseException:
            self.noted |= noted  # written at the next flush
            self.removed |= removed
            raise
        self.full = 0 < self.max_topics <= int(count)
