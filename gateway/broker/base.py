"""The broker seam: where the topic space lives (docs/cluster.md).

The hub asks its broker two questions and makes one kind of call:

* `distributed`: whether publishes of shared topics (ring, snapshot) go through an outside broker, which
  gives them their seq and feeds them back into this node's engine, rather than into the engine at once.
  Private topics never do (docs/cluster.md §8).
* `attached(topic)`: whether the node's engine holds the topic as the broker's stream (a subscribe can go
  on at once); otherwise `attach(topic)` brings it in first.
* the async verbs (`publish`, `attach`, `create`, `delete`, listings) answer with `RequestError`s, among them
  `BrokerUnavailable`.

`InProcessBroker` (inprocess.py) is the default: the engine is the whole topic space, every call answers
at once. `RedisBroker` (redis_broker.py) shares the topic space of several nodes through Redis.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from core import TopicConfig


class Broker(Protocol):
    #: publishes of shared topics go through the broker (a future), not straight into the engine
    distributed: bool
    #: the publishes waiting for the broker met their byte bound: it takes none until they drain
    #: (`when_accepting`); publishers that can wait hold theirs (the ingest), others get `BrokerUnavailable`
    congested: bool
    #: bytes of publishes waiting for the broker, and publishes refused for their bound (`/metrics`)
    pending_bytes: int
    backlog_refused: int

    def when_accepting(self) -> asyncio.Future[None]:
        """A future done once the broker takes publishes again (at once when it does). Cancel it to stop
        waiting."""

    async def start(self) -> None:
        """Connect; raise `BrokerUnreachable` when that is impossible (the gateway does not start)."""

    async def stop(self) -> None: ...

    def publish(self, topic: str, data: Any, seq: int | None, *, creator: Any = None) -> asyncio.Future[int]:
        """Hand a message to the broker; the future gives its seq. Raises at once what can be told at once
        (`BrokerUnavailable`, `BadData`, `MessageTooLarge`, `BadSeq`); the future fails with the rest.
        `creator` (a client's `ClientIdentity`, or None for operators and publishers): whose topic creation
        budget (`Hub.creations`) pays when the publish creates the topic."""

    def attached(self, topic: str) -> bool:
        """Whether the engine holds `topic` as the broker's stream (subscribes go on at once)."""

    def attach(self, topic: str, *, creator: Any = None) -> asyncio.Future[None]:
        """Bring `topic` into the engine at the broker's epoch and history; done once it is live. `creator`:
        as for `publish`, when the attach creates the topic."""

    def hold(self, topic: str) -> None:
        """A local subscriber came: keep the topic attached."""

    def release(self, topic: str) -> None:
        """A local subscriber left: when none is left, detach the topic after a grace."""

    async def create(self, topic: str, config: TopicConfig) -> None:
        """Create the topic cluster-wide with these settings (`TopicExists` if it exists) and attach it."""

    async def delete(self, topic: str) -> None:
        """Remove the topic cluster-wide; every node's subscribers get `closed` `deleted`."""

    async def topics(self) -> list[dict[str, Any]] | None:
        """Cluster-wide topic listing (`GET /api/topics`), or None: the engine's own is the whole."""

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        """A topic the engine does not hold, from the broker; None when the broker has none either."""

    async def cluster_stats(self) -> dict[str, Any] | None:
        """Every node's counters and their sums (`GET /api/stats`), or None for a single process."""


class BrokerUnreachable(Exception):
    """The broker could not be reached at start within `broker.connect_timeout_s`."""
