"""What the Redis broker's helpers (private_queues.py, cluster_info.py) use of their node: its Redis
connection and keys, its identity and the state of the link. `RedisBroker` (redis_broker.py) is one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import redis.asyncio as aioredis

from core import TopicConfig

from .base import BrokerEvents
from .keys import Keys


class RedisNode(Protocol):
    redis: aioredis.Redis
    keys: Keys
    #: this process in the cluster (`P:node:ID`, queue ownership)
    node_id: str
    #: seconds Redis keeps a topic's or a queue's keys without a holder
    ttl: int
    #: whether Redis answers, and why not when it does not
    available: bool
    last_error: str
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

    async def refresh_queues(self) -> None:
        """Keep the private queues this node holds alive in Redis."""

    def reserve(self, size: int) -> None: ...

    def release_bytes(self, size: int) -> None: ...

    async def subscribe_channels(self, channels: list[str]) -> None: ...

    def unsubscribe_channel(self, channel: str) -> None: ...

    def config_from(self, settings: bytes | None) -> TopicConfig | None: ...
