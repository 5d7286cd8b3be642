"""The default broker: the topic space is this process's engine (no Redis).

Every verb answers at once; the only wait is a publish to a full private queue with a deadline, which is
held until the queue frees space (docs/design/private-queues.md §3).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from prometheus_client.core import Metric

from core import Published, QueueFull, RequestError, TopicConfig

from ..auth.identity import ClientIdentity
from ..presence import MemoryPresence, PresenceStore
from .base import BrokerEvents


class InProcessBroker:
    congested = False  # the engine takes every publish at once: nothing waits for a broker
    healthy = True  # nothing to lose (GET /readyz)
    clustered = False
    pending_bytes = 0
    backlog_refused = 0

    def __init__(
        self,
        events: BrokerEvents,
        node_id: str = "",
        control: Callable[[dict[str, Any]], dict[str, Any]] = lambda command: {},
        node_summary: Callable[[bool], dict[str, Any] | None] = lambda watched: None,
    ) -> None:
        self.events = events
        self.presence: PresenceStore = MemoryPresence()
        events.attach_broker(self.presence, None)  # private queues live here: nothing to acknowledge
        self.node_id = node_id
        #: runs an operator's control command here (`Broker.control`)
        self.control_handler = control
        self.node_summary = node_summary  # never asked: there is no other node
        self._held: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        for task in list(self._held):
            task.cancel()

    def when_accepting(self) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def publish_nowait(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published:
        return self.events.apply(topic, data, seq=seq, owner=owner)

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
        future: asyncio.Future[Published] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self.events.apply(topic, data, seq=seq, owner=owner))
        except QueueFull:
            if deadline is None:
                raise
            task = asyncio.get_running_loop().create_task(self._when_space(future, topic, data, seq, owner, deadline))
            self._held.add(task)
            task.add_done_callback(self._held.discard)
        return future

    async def _when_space(
        self, future: asyncio.Future[Published], topic: str, data: Any, seq: int | None, owner: Hashable, deadline: float
    ) -> None:
        """A full private queue: try again each time it frees space, until `deadline`."""
        while not future.done():
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise QueueFull(f"private queue {topic!r} of {owner!r} is full")
                async with asyncio.timeout(remaining):
                    await self.events.space_freed(topic, owner)
                future.set_result(self.events.apply(topic, data, seq=seq, owner=owner))
            except QueueFull as exc:
                if deadline - time.monotonic() <= 0:
                    future.set_exception(exc)
            except asyncio.TimeoutError:
                future.set_exception(QueueFull(f"private queue {topic!r} of {owner!r} is full"))
            except RequestError as exc:
                future.set_exception(exc)

    def creates_here(self, topic: str) -> bool:
        return not self.events.topics.has_topic(topic)

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
        self.events.subscribe(client_id, topic, since=since, request_id=request_id, ack=ack, delta=delta)

    def left(self, topic: str, owner: Hashable, *, unsubscribed: bool) -> None:
        pass

    def committed(self, reports: list[tuple[str, Hashable, int]]) -> None:
        pass

    async def create(self, topic: str, config: TopicConfig) -> dict[str, Any]:
        return self.events.create_topic(topic, config)

    async def delete(self, topic: str) -> int:
        return self.events.deleted(topic)

    async def topics(self) -> list[dict[str, Any]] | None:
        return None

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        return None

    async def cluster_stats(self) -> dict[str, Any] | None:
        return None

    async def cluster_nodes(self, watch_s: float) -> list[dict[str, Any]] | None:
        return None

    async def control(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"node": self.node_id, **self.control_handler(command)}]  # this process is the whole

    def collect(self) -> Iterator[Metric]:
        return iter(())
