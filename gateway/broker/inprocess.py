"""The default broker: the topic space is this process's engine (no Redis, no change of behaviour).

The hub publishes straight into its engine when `distributed` is false, so `publish` here is only the
seam's answer for callers that want a future either way.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from core import TopicConfig

if TYPE_CHECKING:
    from ..hub import Hub


class InProcessBroker:
    distributed = False
    congested = False  # the engine takes every publish at once: nothing waits
    pending_bytes = 0
    backlog_refused = 0

    def __init__(self, hub: "Hub") -> None:
        self.hub = hub

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def publish(self, topic: str, data: Any, seq: int | None, *, creator: Any = None) -> asyncio.Future[int]:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.set_result(self.hub.publish(topic, data, seq=seq).seq)
        return future

    def when_accepting(self) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def attached(self, topic: str) -> bool:
        return True  # the engine creates topics on first use itself

    def attach(self, topic: str, *, creator: Any = None) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def hold(self, topic: str) -> None:
        pass

    def release(self, topic: str) -> None:
        pass

    async def create(self, topic: str, config: TopicConfig) -> None:
        self.hub.engine.create_topic(topic, config)

    async def delete(self, topic: str) -> None:
        self.hub.engine.delete_topic(topic)

    async def topics(self) -> list[dict[str, Any]] | None:
        return None

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        return None

    async def cluster_stats(self) -> dict[str, Any] | None:
        return None
