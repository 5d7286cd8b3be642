"""The topic catalog: the verbs transports, commands and the admin API use on topics, each through the broker;
every subscribe and unsubscribe of a client passes here (`subscribe` asked, `grant` granted, `unsubscribe`).

Subscribes, unsubscribes and publishes take one path whether the topic space is this process's engine or
Redis (the broker routes them, gateway/broker/base.py); the catalog adds what belongs to the client asking:
its creation budget (asked before, charged once the topic was made, in one place here) and its `reply` or
error entry. It reads the engine through the scheduler's read-only view and changes it through its verbs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from typing import Any

from core import Published, TopicConfig
from core.errors import TooManySubscriptions

from .auth.identity import ClientIdentity
from .broker.base import Broker
from .clients import ClientRegistry
from .scheduler import Membership
from .topic_budget import CreationBudget


class TopicCatalog:
    def __init__(self, membership: Membership, clients: ClientRegistry, broker: Broker, creations: CreationBudget) -> None:
        self.membership = membership
        #: the engine, read-only (gateway/topic_view.py)
        self.topics = membership.topics
        self.clients = clients
        self.broker = broker
        #: topic creations by clients: per connection, per address, in total (gateway/topic_budget.py)
        self.creations = creations

    def topic_config(self, name: str) -> TopicConfig | None:
        """The topic's settings, or its rule's for a name no topic has yet (None: no rule creates it)."""
        return self.topics.topic_config(name)

    def _creating(self, identity: ClientIdentity | None, name: str) -> bool:
        """Whether a client's subscribe or publish on `name` creates a topic here (then `_created` charges
        its budget once it did); raises `TooManyCreatedTopics` when the client may create no more. A topic
        the broker creates (in Redis, which alone knows whether it exists) is charged by the broker itself,
        and only when it was created (docs/cluster.md §2)."""
        if identity is None or not self.broker.creates_here(name):
            return False
        self.creations.check(identity)
        return True

    # -- subscribing ---------------------------------------------------------------------------------------

    def subscribe(
        self,
        client_id: str,
        topic: str,
        *,
        since: tuple[str, int] | None = None,
        request_id: Any = None,
        ack: bool = False,
        delta: bool | None = None,
    ) -> None:
        """Subscribe now, or once the broker has the topic (the answer, `subscribed` or an error entry, then
        comes from there). `ack`: a private queue's entries leave on the client's `ack` (`Engine.subscribe`).
        A subscribe that creates the topic here is within the client's creation budget, and charged to it.
        `delta`: the client asked for deltas (None: it did not say; core/delta.py)."""
        identity = self.clients.conns[client_id].identity
        creating = self._creating(identity, topic)  # raises when this client may create no more
        self.broker.subscribe(client_id, topic, since=since, request_id=request_id, creator=identity, ack=ack, delta=delta)
        if creating:
            self.creations.charge(identity)

    def grant(self, client_id: str, topic: str, *, since: tuple[str, int] | None = None, request_id: Any = None) -> None:
        """Subscribe a client to what was granted it, not asked by it: the connect hook's server-side
        subscriptions (gateway/session.py `open`, gateway/centrifugo/server_subs.py) and an operator's
        (gateway/user_commands.py). No permission check and no creation budget (docs/integration.md: the
        backend or the operator decided); the client gets `subscribed` with `request_id`, or an error entry."""
        self.broker.subscribe(
            client_id, topic, since=since, request_id=request_id, creator=self.clients.conns[client_id].identity
        )

    def check_room(self, client_id: str, topic: str) -> None:
        """`TooManySubscriptions` when the client holds `scheduler.max_subscriptions` subscriptions and `topic`
        is not one of them: asked before a subscribe takes a token of `limits.subscribe_rate`, so a client at
        its cap is told so (not `rate_limited`) and spends nothing. The engine checks again when it subscribes
        (with a broker, subscribes still attaching are not counted here)."""
        if not self.topics.has_client(client_id):
            return
        subs = self.topics.client(client_id).subs
        limit = self.topics.config.max_subscriptions
        if len(subs) >= limit and topic not in subs:
            raise TooManySubscriptions(f"at most {limit} subscriptions per client (scheduler.max_subscriptions)")

    def unsubscribe(self, client_id: str, topic: str, *, request_id: Any = None) -> None:
        """Unsubscribe, whoever asks (the client's command, an operator, a lost Centrifugo subscription): the
        `unsubscribed` entry, presence left, the broker's holders, the unsubscribe hook's event."""
        owner = self.membership.unsubscribe(client_id, topic, request_id=request_id)
        self.broker.left(topic, owner, unsubscribed=True)
        self.clients.hooks.unsubscribed(self.clients.conns[client_id].identity, topic)  # the unsubscribe hook's event

    def ack(self, client_id: str, topic: str, seq: int) -> int:
        """Commit an acknowledged private subscription's entries up to `seq`; the first seq still queued."""
        return self.membership.ack(client_id, topic, seq)

    # -- publishing ----------------------------------------------------------------------------------------

    @property
    def congested(self) -> bool:
        """The broker holds more unanswered publishes than it takes (`broker.max_pending_bytes`)."""
        return self.broker.congested

    def when_accepting(self) -> asyncio.Future[None]:
        """Done when the broker takes publishes again (Redis back, or its backlog under the bound)."""
        return self.broker.when_accepting()

    def space_freed(self, topic: str, owner: Hashable) -> asyncio.Future[None]:
        """Done when the private queue `topic` of `owner`, full, has room again."""
        return self.membership.space_freed(topic, owner)

    def publish_nowait(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published | None:
        """The ingest's fast path: published at once (or raised) when the topic lives here, None when it goes
        through the broker (then `publish`)."""
        return self.broker.publish_nowait(topic, data, seq=seq, owner=owner)

    def publish(
        self,
        topic: str,
        data: Any,
        *,
        seq: int | None = None,
        owner: Hashable = None,
        creator: ClientIdentity | None = None,
        timeout: float | None = None,
    ) -> asyncio.Future[Published]:
        """Publish through the broker: a future of the `Published`. `timeout`: how long a full private queue
        holds the publish before `QueueFull` (None: at once)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.broker.publish(topic, data, seq=seq, owner=owner, creator=creator, deadline=deadline)

    def publish_reply(self, client_id: str, topic: str, data: Any, request_id: Any) -> None:
        """A client's publish: its `reply` with the seq comes now, or when the broker has given it. A publish
        that creates the topic here is within the client's creation budget, and charged to it."""
        conn = self.clients.conns.get(client_id)
        identity = conn.identity if conn is not None else None
        creating = self._creating(identity, topic)  # raises when this client may create no more
        future = self.publish(topic, data, creator=identity)
        self.clients.reply_when_done(client_id, request_id, future, lambda published: {"seq": published.seq}, "publish")
        if creating and identity is not None:
            self.creations.charge(identity)

    # -- topics (admin API) ----------------------------------------------------------------------------------

    async def create_topic(self, name: str, config: TopicConfig) -> dict[str, Any]:
        """Create a topic (cluster-wide with Redis); returns its INFO."""
        return await self.broker.create(name, config)

    async def delete_topic(self, name: str) -> int:
        """Remove a topic (cluster-wide with Redis). Returns how many local subscribers were told."""
        return await self.broker.delete(name)

    async def topics_info(self) -> list[dict[str, Any]]:
        """INFO of every topic: the cluster's (from the broker), else this engine's."""
        listed = await self.broker.topics()
        if listed is None:
            return [t.info() for t in self.topics.topics()]
        names = {info["name"] for info in listed}
        return listed + [t.info() for t in self.topics.topics() if t.name not in names]

    async def topic_info(self, name: str) -> dict[str, Any]:
        if self.topics.has_topic(name):
            info: dict[str, Any] = self.topics.topic(name).info()
            return info
        listed = await self.broker.topic_info(name)
        if listed is None:
            return dict(self.topics.topic(name).info())  # raises UnknownTopic
        return listed
