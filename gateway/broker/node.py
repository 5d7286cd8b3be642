"""What the Redis broker's helpers (private_queues.py, cluster_info.py, control.py, presence_store.py) use of
their node: its Redis connection and keys, its identity, its link and its publisher. `RedisBroker`
(redis_broker.py) is one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import redis.asyncio as aioredis

from .base import BrokerEvents
from .keys import Keys
from .link import Link
from .publishing import Publisher


class RedisNode(Protocol):
    redis: aioredis.Redis
    keys: Keys
    #: this process in the cluster (`P:node:ID`, queue ownership)
    node_id: str
    #: seconds Redis keeps a topic's or a queue's keys without a holder
    ttl: int
    #: the loaded scripts' SHA-1s by name (scripts.py)
    shas: dict[str, str]
    events: BrokerEvents
    #: runs an operator's control command on this node (control.py)
    control_handler: Callable[[dict[str, Any]], dict[str, Any]]
    #: this node's client summary for the stats stream (cluster_info.py; the stats feed's `node_summary`)
    node_summary: Callable[[bool], dict[str, Any] | None]

    @property
    def lines(self) -> Mapping[str, object]:
        """The topics this node serves from Redis streams."""

    #: the connections to Redis (channels subscribed through it), and the byte bound of what waits for Redis
    link: Link
    publisher: Publisher

    @property
    def available(self) -> bool:
        """Whether Redis answers."""

    @property
    def last_error(self) -> str:
        """Why not, when it does not."""

    async def refresh_queues(self) -> None:
        """Keep the private queues this node holds alive in Redis."""
