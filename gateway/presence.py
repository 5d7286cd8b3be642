"""Presence: who is subscribed to a topic with `presence = true` (docs/integration.md, "Presence").

A topic's members are its current subscribers: a client joins on a successful subscribe and leaves on
unsubscribe, disconnect, kick or topic delete. The scheduler reports each join and leave (`Presence.joined`,
`Presence.left`, `Presence.topic_gone`), from the one place each happens: `Membership.subscribe` (every
shared-topic subscribe, at once or once the broker has the topic), `Membership.unsubscribe`,
`ClientRegistry.unregister` (disconnect and kick) and `Membership.deleted` (gateway/scheduler.py). Each costs O(1) (a dict and a
counter). On a topic with `join_leave` the change is also noted for announcement: the scheduler sends the
noted changes before a cycle (`Presence.flush`), at most once per `FLUSH_INTERVAL_S`, one direct entry per
change per local subscriber (none above `limits.presence_max_members` subscribers). A member's join and leave
noted before they went cancel out: a client toggling a subscription costs the other members nothing, and
however many clients come and go, a member gets join/leave entries at most 10 times a second. A subscriber
may decline a topic's join/leave entries (`decline_join_leave`: a Centrifugo subscription that did not ask
for them); none is queued for it, so the entries stay the same bytes for every subscriber that gets them.

Where members are kept is the broker's business (`Broker.presence`, a `PresenceStore`): `MemoryPresence`
here for one process, `RedisPresence` (gateway/broker/presence_store.py) for a cluster. Nobody asks which.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from core import RequestError
from core.entries import encode_join, encode_leave

from .auth.identity import ClientIdentity
from .topic_view import TopicView

#: noted joins and leaves are sent at most this often: what changed meanwhile goes together (and what was
#: undone meanwhile not at all), so join/leave traffic costs a member at most 10 frames a second
FLUSH_INTERVAL_S = 0.1
#: a flush due within this much goes now: the loop's timers may fire that early
FLUSH_SLACK_S = 0.001
#: changes of one topic sent per flush at most; the rest wait for the next ones (a reconnect storm of 1,000
#: clients into a room must not put 1,000 entries at once in every member's direct queue, whose bound,
#: `scheduler.direct_queue_max`, would close them all)
MAX_CHANGES_PER_FLUSH = 100


@dataclass(frozen=True, slots=True)
class Member:
    """One subscriber of a presence topic."""

    client: str
    #: the token's user, None while anonymous
    user: str | None
    #: the connection's `ClientIdentity.info` (a JWT's `info` claim, or a backend's answer), None if none
    info: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def owner(self) -> str:
        """Who the member counts as in `users`: its user, or itself when anonymous."""
        return self.user if self.user is not None else self.client

    def as_dict(self) -> dict[str, Any]:
        return {"user": self.user, "client": self.client, "info": self.info}


@dataclass(frozen=True, slots=True)
class PresenceView:
    """What `presence` answers: the counts, and the members unless there are more than the bound."""

    topic: str
    clients: int
    users: int
    #: None: counts only (more than `limits.presence_max_members` members)
    members: list[Member] | None

    def as_dict(self, *, with_members: bool = True) -> dict[str, Any]:
        answer: dict[str, Any] = {"topic": self.topic, "clients": self.clients, "users": self.users}
        if with_members:
            answer["members"] = None if self.members is None else [m.as_dict() for m in self.members]
        return answer


@dataclass(slots=True)
class TopicMembers:
    """One topic's members (on this node, or in this process): O(1) per join and leave."""

    clients: dict[str, Member] = field(default_factory=dict)
    #: members per owner (`Member.owner`): its length is the `users` count
    owners: Counter[str] = field(default_factory=Counter)

    def add(self, member: Member) -> bool:
        if member.client in self.clients:
            return False
        self.clients[member.client] = member
        self.owners[member.owner] += 1
        return True

    def remove(self, client: str) -> Member | None:
        member = self.clients.pop(client, None)
        if member is not None:
            owner = member.owner
            self.owners[owner] -= 1
            if self.owners[owner] <= 0:
                del self.owners[owner]
        return member

    def view(self, topic: str, limit: int) -> PresenceView:
        count = len(self.clients)
        return PresenceView(topic, count, len(self.owners), list(self.clients.values()) if count <= limit else None)


class PresenceStore(Protocol):
    """Where a broker keeps presence members (broker/base.py `Broker.presence`)."""

    def join(self, topic: str, member: Member) -> None:
        """A local client joined `topic` (other nodes are told, with a cluster)."""

    def leave(self, topic: str, client: str) -> Member | None:
        """A local client left `topic`: its member, None when it was none."""

    def topic_gone(self, topic: str) -> None:
        """The topic was deleted: this node's members of it are forgotten (no leave entries: nobody is left)."""

    def view(self, topic: str, limit: int) -> asyncio.Future[PresenceView]:
        """The topic's members (cluster-wide with a cluster), or counts only above `limit` members."""


class MemoryPresence:
    """The in-process store: every member is a local one."""

    def __init__(self) -> None:
        self.topics: dict[str, TopicMembers] = {}

    def join(self, topic: str, member: Member) -> None:
        members = self.topics.get(topic)
        if members is None:
            members = self.topics[topic] = TopicMembers()
        members.add(member)

    def leave(self, topic: str, client: str) -> Member | None:
        members = self.topics.get(topic)
        if members is None:
            return None
        member = members.remove(client)
        if not members.clients:
            del self.topics[topic]
        return member

    def topic_gone(self, topic: str) -> None:
        self.topics.pop(topic, None)

    def view(self, topic: str, limit: int) -> asyncio.Future[PresenceView]:
        future: asyncio.Future[PresenceView] = asyncio.get_running_loop().create_future()
        members = self.topics.get(topic)
        future.set_result(members.view(topic, limit) if members is not None else PresenceView(topic, 0, 0, []))
        return future


class Presence:
    """The scheduler's presence tracking: joins and leaves to the broker's store, join/leave entries to the
    topic's local subscribers, coalesced per cycle."""

    def __init__(
        self,
        topics: TopicView,
        send: Callable[[Hashable, bytes], None],
        kick_overflowed: Callable[[Hashable], None],
        max_members: int,
        wake: Callable[[], None],
    ) -> None:
        self.topics = topics
        #: queue one direct entry for a client (the engine's own, raising `DirectQueueFull`: no wake-up per
        #: entry, the flush runs just before a cycle)
        self.send = send
        #: how a subscriber whose direct queue overflowed is dropped (after the announcing loop, never inside it)
        self.kick_overflowed = kick_overflowed
        #: limits.presence_max_members: above it answers are counts only and join/leave entries are not sent
        self.max_members = max_members
        #: tells the scheduler that changes wait for `flush`
        self.wake = wake
        #: the broker's store (`Membership.attach_broker`)
        self.store: PresenceStore = MemoryPresence()
        #: changes noted since the last flush: topic -> member client -> (kind, member), in the order noted
        self.pending: dict[str, dict[str, tuple[str, Member]]] = {}
        #: changes that cancelled out before they were sent (a join and a leave of the same member)
        self.cancelled = 0
        #: when changes were last sent (monotonic seconds)
        self.last_flush = float("-inf")
        #: per client, the topics whose joins and leaves it declined (a Centrifugo `subscribe` without
        #: `join_leave`): none is queued for it there. Forgotten as it leaves a topic and when it goes
        #: (`forget`); at most `bound` + 1 topics a client (`decline_join_leave`)
        self.declined: dict[Hashable, set[str]] = {}

    def joined(self, client_id: Hashable, topic: str) -> None:
        """`client_id` subscribed to `topic` (after the engine's subscribe succeeded)."""
        topics = self.topics
        if not topics.has_topic(topic):
            return
        config = topics.topic(topic).config
        if not config.presence:
            return
        member = _member(topics, client_id)
        self.store.join(topic, member)
        if config.join_leave:
            self.announce(topic, "join", member)

    def decline_join_leave(self, client_id: Hashable, topic: str, declined: bool, bound: int) -> None:
        """Whether `client_id` declines the joins and leaves of `topic` (before it subscribes; a client
        declines nothing until it says so). `bound`: its subscriptions at most (scheduler.max_subscriptions):
        when it declines that many topics, those it no longer subscribes to (a subscribe refused, a topic
        deleted) are dropped first."""
        mine = self.declined.get(client_id)
        if not declined:
            if mine is not None:
                mine.discard(topic)
                if not mine:
                    del self.declined[client_id]
            return
        if mine is None:
            mine = self.declined[client_id] = set()
        elif len(mine) >= bound:
            mine.intersection_update(self.topics.client(client_id).subs)
        mine.add(topic)

    def forget(self, client_id: Hashable) -> None:
        """The client is gone: its choices too."""
        self.declined.pop(client_id, None)

    def left(self, client_id: Hashable, topic: str) -> None:
        """`client_id` no longer subscribes to `topic` (unsubscribed, disconnected, kicked)."""
        mine = self.declined.get(client_id)
        if mine is not None:
            mine.discard(topic)
            if not mine:
                del self.declined[client_id]
        member = self.store.leave(topic, str(client_id))
        if member is None:
            return
        topics = self.topics
        if topics.has_topic(topic) and topics.topic(topic).config.join_leave:
            self.announce(topic, "leave", member)

    def topic_gone(self, topic: str) -> None:
        self.store.topic_gone(topic)
        self.pending.pop(topic, None)

    def due_at(self) -> float:
        """When the changes noted may be sent (monotonic seconds)."""
        return self.last_flush + FLUSH_INTERVAL_S

    def announce(self, topic: str, kind: str, member: Member) -> None:
        """Note a join or leave (of this node's member, or another node's) for the next `flush`: O(1). A change
        that undoes one still pending removes both."""
        if self._note(topic, kind, member):
            self.wake()

    def _note(self, topic: str, kind: str, member: Member) -> bool:
        """Whether the change is pending now (False: it cancelled one out)."""
        changes = self.pending.get(topic)
        if changes is None:
            changes = self.pending[topic] = {}
        previous = changes.get(member.client)
        if previous is not None and previous[0] != kind:
            del changes[member.client]
            self.cancelled += 2
            return False
        changes[member.client] = (kind, member)
        return True

    def flush(self, now: float) -> None:
        """Send the noted changes, if `FLUSH_INTERVAL_S` has passed since the last time: one `join` / `leave`
        direct entry per change to each local subscriber of its topic but the member itself and those that
        declined them (`declined`). O(changes x local subscribers), nothing when none is pending. A subscriber
        whose direct queue overflows is kicked once the loop is over (its own leave is then noted for the next
        flush), so the loop never meets a client it dropped."""
        if not self.pending:
            return
        if now + FLUSH_SLACK_S < self.due_at():
            self.wake()  # not yet: the scheduler's timer (armed once) brings it back when due
            return
        self.last_flush = now
        pending, self.pending = self.pending, {}
        topics, send, declined = self.topics, self.send, self.declined
        overflowed: dict[Hashable, None] = {}
        later: list[tuple[str, str, Member]] = []
        for topic, changes in pending.items():
            if not changes or not topics.has_topic(topic):
                continue
            t = topics.topic(topic)
            if not t.config.join_leave or len(t.subs) > self.max_members:
                continue
            now_sent = list(changes.items())
            if len(now_sent) > MAX_CHANGES_PER_FLUSH:
                later += [(topic, kind, member) for _, (kind, member) in now_sent[MAX_CHANGES_PER_FLUSH:]]
                now_sent = now_sent[:MAX_CHANGES_PER_FLUSH]
            entries = [
                (client, (encode_join if kind == "join" else encode_leave)(topic, member.user, client))
                for client, (kind, member) in now_sent
            ]
            for sub in t.subs:
                client_id = sub.client.id
                if client_id in overflowed:
                    continue
                if declined:
                    mine = declined.get(client_id)
                    if mine is not None and topic in mine:
                        continue
                try:
                    for client, entry in entries:
                        if client != client_id:
                            send(client_id, entry)
                except RequestError:  # DirectQueueFull: it does not read its entries
                    overflowed[client_id] = None
        for client_id in overflowed:
            self.kick_overflowed(client_id)
        for topic, kind, member in later:  # noted again: one undone by a kick above cancels out
            self._note(topic, kind, member)
        if self.pending:
            self.wake()


def _member(topics: TopicView, client_id: Hashable) -> Member:
    identity = topics.client(client_id).info  # the registry connects every client with its ClientIdentity
    if not isinstance(identity, ClientIdentity):
        return Member(str(client_id), None, None)
    return Member(str(client_id), identity.user, identity.info)
