"""The broker seam: where the topic space lives (docs/cluster.md).

Every subscribe and publish goes through the node's broker, in one process as in a cluster, as in
centrifuge's node: `InProcessBroker` (inprocess.py, the default) answers at once from this process's
engine; `RedisBroker` (redis_broker.py) answers once Redis has ordered the message, then feeds it back to
every node. Which topics a broker keeps elsewhere (shared topics in Redis streams, private queues in Redis
lists) is the broker's own business: nobody outside asks.

A broker never sees the hub nor the engine. It is given `BrokerEvents` (the scheduler's `Membership`,
gateway/scheduler.py): it reads the engine through its read-only `topics` view and reports through its verbs
what reaches this node's engine: a message applied at its seq, a gap skipped, a topic created, restarted or
deleted, a private queue evicted, queue space freed. Each event wakes the scheduler itself, so no broker can
forget a wake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

from prometheus_client.core import Metric

from core import Published, RequestError, TopicConfig

from ..auth.identity import ClientIdentity
from ..presence import Member, PresenceStore
from ..topic_view import TopicView


class BrokerEvents(Protocol):
    """What a broker may do to this node: read the engine, and change it only through these events."""

    #: read the engine freely (topic_config, has_topic, topic(...).subs, counters); change it through the verbs
    #: below
    topics: TopicView

    def attach_broker(self, presence: PresenceStore, commits: Callable[[list[tuple[str, Hashable, int]]], None] | None) -> None:
        """Called once by the broker as it is made: where presence members are kept, and where private
        queues' commits go (None: nowhere, the queues live in this engine)."""

    def resolve(self, topic: str) -> None:
        """The local topic, created on first use by its rule (raises the rule's errors: unknown topic)."""

    def create_topic(
        self, name: str, config: TopicConfig | None = None, *, epoch: str | None = None, start: int = 0
    ) -> dict[str, Any]:
        """A new local topic (`TopicExists`, `TooManyTopics`); `epoch`, `start`: a broker's stream. Its INFO."""

    def restart_topic(self, name: str, epoch: str, start: int) -> None:
        """The topic's stream changed epoch: subscribers read on from `start` (docs/cluster.md §4)."""

    def apply(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published:
        """Put one message into the engine (raises what the engine raises: `QueueFull`, `StaleSeq`, ...)."""

    def skip(self, topic: str, upto: int) -> None:
        """Seqs below `upto` are lost here: subscribers behind it get the loss notice."""

    def deleted(self, topic: str) -> int:
        """The topic is gone; its local subscribers get `closed`. Returns how many there were."""

    def evicted(self, topic: str, owner: Hashable, reason: str) -> bool:
        """A private queue's local handle is closed (taken over elsewhere, or lost)."""

    def subscribe(
        self,
        client_id: str,
        topic: str,
        *,
        since: tuple[str, int] | None = None,
        request_id: Any = None,
        queue_start: tuple[str, int] | None = None,
        ack: bool = False,
        delta: bool | None = None,
    ) -> None:
        """Subscribe a local client now (raises the engine's errors); it joins the topic's presence."""

    def presence_changed(self, topic: str, kind: str, member: Member) -> None:
        """A client of another node joined or left `topic` ("join" / "leave"): local subscribers are told."""

    def joined(
        self,
        client_id: str,
        topic: str,
        *,
        since: tuple[str, int] | None = None,
        request_id: Any = None,
        queue_start: tuple[str, int] | None = None,
        delta: bool | None = None,
    ) -> None:
        """A subscribe that waited for the broker goes on now (its answer, or its error, reaches the client)."""

    def refused(self, client_id: str, error: RequestError, request_id: Any = None) -> None:
        """A subscribe that waited for the broker failed: the client gets the error (if still connected)."""

    def connected(self, client_id: str) -> bool:
        """Whether the client is still on this node."""

    def client_count(self) -> int:
        """Clients connected to this node (the cluster-wide stats)."""

    def space(self) -> None:
        """Queue space may have been freed (commits, evictions): held publishers retry."""

    def space_freed(self, topic: str, owner: Hashable) -> asyncio.Future[None]:
        """A future done when the private queue (topic, owner) frees space or disappears."""

    def wake(self) -> None:
        """The engine may have work."""


class Broker(Protocol):
    @property
    def congested(self) -> bool:
        """The publishes waiting for the broker met their byte bound: it takes none until they drain
        (`when_accepting`); publishers that can wait hold theirs (the ingest), others get `BrokerUnavailable`."""

    #: where presence members are kept (gateway/presence.py): this process's memory, or Redis
    presence: PresenceStore

    @property
    def healthy(self) -> bool:
        """Whether the broker answers now (GET /readyz, gateway/ops/readiness.py): always, in this process."""

    def when_accepting(self) -> asyncio.Future[None]:
        """A future done once the broker takes publishes again (at once when it does). Cancel it to stop
        waiting."""

    async def start(self) -> None:
        """Connect; raise `BrokerUnreachable` when that is impossible (the gateway does not start)."""

    async def stop(self) -> None: ...

    # -- publishing: one path -----------------------------------------------------------------------------

    def publish_nowait(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published | None:
        """Publish at once when the topic lives in this engine: its `Published`, or raise (`QueueFull` is
        back-pressure). None: the topic lives in the broker, so use `publish` (the ingest's fast path)."""

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
        """Publish; the future gives the `Published` (at once in-process, after Redis's script otherwise).
        Raises at once what can be told at once (`BrokerUnavailable`, `BadData`, `MessageTooLarge`, `BadSeq`);
        the future fails with the rest. `owner`: the user whose private queue gets it. `deadline`
        (monotonic): a full private queue holds the publish until then, then `QueueFull`; None: `QueueFull`
        at once. `creator` (a client's identity, None for operators and publishers): whose topic creation
        budget pays when the publish creates the topic."""

    # -- subscribing ----------------------------------------------------------------------------------------

    def creates_here(self, topic: str) -> bool:
        """Whether a client's first use of `topic` creates it in this engine (the topic catalog charges the
        client's creation budget); False when the broker creates it (and charges the budget itself)."""

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
        """Subscribe now, or once the broker has brought the topic in (the answer then comes through
        `BrokerEvents.joined` / `refused`). Raises what can be told at once. `ack`: private topics, entries
        leave the queue on the client's `ack` (docs/design/private-queues.md §9). `delta`: shared topics,
        the client asked for deltas (core/delta.py)."""

    def left(self, topic: str, owner: Hashable, *, unsubscribed: bool) -> None:
        """A local subscriber of `topic` left (after the engine's unsubscribe or disconnect); `unsubscribed`:
        it asked to (a private queue then leaves the broker too), else its connection ended."""

    def committed(self, reports: list[tuple[str, Hashable, int]]) -> None:
        """Private queues' commits to acknowledge: (topic, owner, first seq still queued)."""

    # -- topics (admin API) ---------------------------------------------------------------------------------

    async def create(self, topic: str, config: TopicConfig) -> dict[str, Any]:
        """Create the topic (cluster-wide with Redis; `TopicExists` if it exists); returns its INFO."""

    async def delete(self, topic: str) -> int:
        """Remove the topic (cluster-wide with Redis); every subscriber gets `closed` `deleted`. Returns how
        many local subscribers were told."""

    async def topics(self) -> list[dict[str, Any]] | None:
        """Cluster-wide topic listing (`GET /api/topics`), or None: the engine's own is the whole."""

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        """A topic the engine does not hold, from the broker; None when the broker has none either."""

    async def cluster_stats(self) -> dict[str, Any] | None:
        """Every node's counters and their sums (`GET /api/stats`), or None for a single process."""

    #: this process in the cluster (the instance id in-process), and whether other nodes may share the topic
    #: space (False in-process: this process is the whole)
    node_id: str
    clustered: bool
    #: this node's client summary for the other nodes' stats streams, or None; called every second by the
    #: stats refresher with whether some node's stream has a viewer (given at construction: the stats feed's,
    #: gateway/stats_feed.py; never called in-process)
    node_summary: Callable[[bool], dict[str, Any] | None]

    async def cluster_nodes(self, watch_s: float) -> list[dict[str, Any]] | None:
        """Every live node's stats with its summary (`dash`) when it has one, for the stats stream, and the
        cluster marked watched for `watch_s` seconds; None for a single process. Raises
        `BrokerUnavailable`."""

    # -- operators' control commands (admin API; gateway/broker/control.py) --------------------------------

    #: runs a control command on this node and returns its answer (given at construction: the operators'
    #: `ControlCommands.run`, gateway/control_commands.py: kick, disconnect, revoke, list)
    control_handler: Callable[[dict[str, Any]], dict[str, Any]]

    async def control(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        """Run `command` on every node: this one first (at once; what it raises is raised), then, with Redis,
        every other node through the control channel. Returns the answers that came within the bound
        (control.py: `CONTROL_REPLY_TIMEOUT_S`), this node's first, each with its `node`. With Redis
        unreachable: `BrokerUnavailable` after this node ran it."""

    def collect(self) -> Iterator[Metric]:
        """The broker's families for /metrics."""


class BrokerUnreachable(Exception):
    """The broker could not be reached at start within `broker.connect_timeout_s`."""
