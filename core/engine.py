"""The broadcaster engine and its fair scheduler (docs/design/batching.md), sans-I/O.

The I/O layer drives it with verbs and writes what `run_cycle` returns:

* `connect` / `disconnect`, `subscribe` / `unsubscribe`, `publish` / `reserve`, `send_direct`;
* `mark_ready` when a client can take a batch (WebSocket: its last write drained; long-poll: a poll waits),
  `mark_idle` when it cannot (a long-poll returned empty);
* `ack` when a client acknowledges private entries of a subscription made with `ack` (their commit);
* `run_cycle()` returns one `Batch` per eligible client; each such client is then WRITING and gets nothing
  more until the I/O layer calls `write_done` (commit + ready) or `commit` and later `mark_ready`;
* `release(now)` ends the lingers that are due (topics with `linger`: `lingering`, `next_release`);
* `tick(now)` gives up out-of-order holes that timed out; `take_space_freed()` names the private queues
  whose waiting publishers should retry; `reclaim(now, ttl)` removes rule-created topics that stayed
  unused (no subscriber, nothing retained) for `ttl`.

Costs: a publish is O(1) plus O(1) per subscriber that was caught up (idle), which a topic with a linger
wakes at `release` instead (O(log topics lingering) per linger); `run_cycle` is
O(active clients + active handles + entries emitted); subscribe, unsubscribe and disconnect are
O(that client's subscriptions). Nothing walks all clients or all topics.

The engine does not ask which kind a topic is: each kind answers the calls of `topics.Topic` (publish,
claim / attach / detach, read_into / has_data, commit / rollback, expire_hole, reserve) and declares what
the hot paths read as attributes (`shared`, `pending`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from .client import Client, ClientState, Crowd, Sink, Subscription
from .config import MAX_SEQ, EngineConfig, TopicConfig, TopicKind
from .counters import Counters
from .entries import FRAME_OVERHEAD, encode_closed, encode_loss, encode_subscribed, encode_unsubscribed, frame_batch
from .errors import (
    AlreadySubscribed,
    BadAck,
    BadSeq,
    CoreUsageError,
    DirectQueueFull,
    NotSubscribed,
    TooManySubscriptions,
    TooManyTopics,
    TopicExists,
    UnknownTopic,
)
from .fairness import FairShare, Tenant, User
from .private import PrivateTopic
from .ring import RingTopic
from .snapshot import SnapshotTopic
from .topics import Topic, check_topic_name

#: names whose rule lookup `Engine._rule_for` remembers (cleared when full)
RULE_CACHE_MAX = 4096

_TOPIC_CLASSES: dict[TopicKind, type[Topic]] = {
    TopicKind.RING: RingTopic,
    TopicKind.SNAPSHOT: SnapshotTopic,
    TopicKind.PRIVATE: PrivateTopic,
}


class Batch:
    """Entries for one client, to be written as one frame / response / write. Read-only by contract.

    A plain class, not a dataclass: compiled, its `__init__` is C (a dataclass's generated one stays
    Python, ~0.3 us, once per client per cycle)."""

    __slots__ = ("client_id", "entries", "size", "more")

    def __init__(self, client_id: Hashable, entries: list[bytes], size: int, more: bool = False) -> None:
        self.client_id = client_id
        self.entries = entries
        self.size = size
        #: the client has more for the next cycle (a backlog, replies past the budget): false when caught up
        self.more = more

    def __repr__(self) -> str:
        return f"Batch({self.client_id!r}, {len(self.entries)} entries, {self.size} bytes, more={self.more})"

    def frame(self) -> bytes:
        return frame_batch(self.entries)


@dataclass(frozen=True, slots=True)
class Subscribed:
    topic: str
    kind: str
    epoch: str
    seq: int


@dataclass(frozen=True, slots=True)
class Published:
    topic: str
    seq: int


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, instance_id: str = "0") -> None:
        self.config = config or EngineConfig()
        self.instance_id = instance_id
        self.counters = Counters()
        self._topics: dict[str, Topic] = {}
        self._clients: dict[Hashable, Client] = {}
        #: ordered, coalesced active-client set: READY clients with work (docs/design/batching.md §3)
        self._active: dict[Client, None] = {}
        #: topics with out-of-order arrivals waiting on a hole (`Topic.pending`), for `tick`
        self._holey: dict[Topic, None] = {}
        #: topics holding caught-up subscribers back (`TopicConfig.linger`), with when to wake them
        self._lingering: dict[Topic, float] = {}
        #: the same deadlines as a heap (deadline, hold number, topic); entries of lingers that ended early
        #: stay until their deadline passes
        self._deadlines: list[tuple[float, int, Topic]] = []
        self._holds = 0
        self._space_freed: list[tuple[str, Hashable]] = []
        #: bytes in all clients' direct queues (bounded by `EngineConfig.direct_total_max_bytes`)
        self.direct_bytes = 0
        #: whether `commit` reports what left each private queue (`take_committed`): a broker acks it
        self.report_commits = False
        self._committed: list[tuple[str, Hashable, int]] = []
        self._epochs = 0
        #: rule-created topics that lost (or never had) a subscriber since the last `reclaim`
        self._unused_new: dict[Topic, None] = {}
        #: rule-created topics without a subscriber, oldest first, with when `reclaim` first saw them so
        self._unused: dict[Topic, float] = {}
        #: rule-created topics without a subscriber that retain data, oldest first: when `reclaim` put them
        #: here and their `activity()` then; removed once it has not changed for the retained ttl
        self._retained: dict[Topic, tuple[float, int]] = {}
        #: rule lookups of names no topic has (`_rule_for`), at most RULE_CACHE_MAX
        self._rules_seen: dict[str, TopicConfig | None] = {}
        #: whether `run_cycle` gathers clients with an open sink into `crowds` instead of giving them batches
        self.crowding = False
        #: the last cycle's crowds (`take_crowds`)
        self.crowds: list[Crowd] = []
        #: tenants and users (`enable_fairness`); None: the flat cycle, one batch per ready client
        self.fair: FairShare | None = None

    # -- topics ----------------------------------------------------------------------------------------

    def create_topic(self, name: str, config: TopicConfig | None = None, *, epoch: str | None = None, start: int = 0) -> Topic:
        """A new topic. `epoch` and `start` (a broker's stream, docs/cluster.md §3): the topic's epoch and
        first seq; by default a new epoch of this engine, from seq 0."""
        if name in self._topics:
            raise TopicExists(f"topic {name!r} exists")
        check_topic_name(name, self.config.max_topic_name)
        if len(self._topics) >= self.config.max_topics:
            raise TooManyTopics(f"the gateway holds its maximum of {self.config.max_topics} topics")
        config = config or self.config.rule_for(name) or TopicConfig()
        self._epochs += 1
        topic = _TOPIC_CLASSES[config.kind](name, f"{self.instance_id}-{self._epochs}", config, self.counters)
        topic.max_message_bytes = self.config.max_message_bytes
        if epoch is not None or start:
            topic.restart(epoch or topic.epoch, start)
        self._topics[name] = topic
        return topic

    def restart_topic(self, name: str, epoch: str, start: int) -> None:
        """Begin a new epoch at seq `start` (a broker's stream changed epoch, docs/cluster.md §4). Each
        subscriber gets `loss [cursor, null)` `epoch`, then `subscribed` (id null) with the new epoch and
        seq, and reads on from there. Cost: O(subscribers of the topic); a rare event."""
        topic = self.topic(name)
        topic.restart(epoch, start)
        for sub in topic.subs:
            client = sub.client
            cursor = sub.cursor
            begin, _ = topic.attach(sub, None)
            self.counters.loss_notices += 1
            # past the bound, like `delete_topic`: two per subscription, once per epoch change
            self._queue(client, encode_loss(name, cursor, None, "epoch"))
            self._queue(client, encode_subscribed(name, topic.kind, epoch, begin))
            self._note_work(client)

    def skip(self, name: str, upto: int, now: float = 0.0) -> bool:
        """Seqs of topic `name` below `upto` that did not arrive never will (a broker's stream dropped them):
        subscribers get the exact range as a loss notice. Returns whether the available end moved."""
        topic = self.topic(name)
        if not topic.skip_to(upto, now):
            return False
        self._wake(topic.take_idle())
        return True

    def delete_topic(self, name: str) -> int:
        """Remove a topic; each subscriber gets a `closed` entry. Returns how many were subscribed."""
        topic = self.topic(name)
        subs = list(topic.subs)
        for sub in subs:
            client = sub.client
            del client.subs[name]
            self._drop_sub(sub)
            self._queue(client, encode_closed(name, "deleted"))  # past the bound: one per subscription
            self._note_work(client)
        self._forget(topic)
        return len(subs)

    def _forget(self, topic: Topic) -> None:
        del self._topics[topic.name]
        self._holey.pop(topic, None)
        self._lingering.pop(topic, None)
        self._unused_new.pop(topic, None)
        self._unused.pop(topic, None)
        self._retained.pop(topic, None)

    def reclaim(self, now: float, ttl: float, retained_ttl: float = 0.0) -> list[str]:
        """Remove rule-created topics with no subscriber and no retained data for at least `ttl` seconds,
        so names that clients try cannot fill `max_topics` for good; and, when `retained_ttl` > 0, those
        that retain data (messages, a last value) but had no subscriber and no publish for `retained_ttl`
        (checked every `retained_ttl - ttl` seconds: a topic goes between one and two of them after its
        last use). Returns the names removed.

        Cost: O(topics that became unused since the last call + topics removed or kept): each unused
        topic is stamped once, then looked at once when its time is up (a retained one once per period).
        """
        unused = self._unused
        for topic in self._unused_new:
            unused.pop(topic, None)
            self._retained.pop(topic, None)
            unused[topic] = now
        self._unused_new.clear()
        removed: list[str] = []
        retained = self._retained
        while unused:
            topic = next(iter(unused))
            if unused[topic] + ttl > now:
                break
            del unused[topic]
            if topic.subs:
                continue
            if not topic.retains_data():
                self._forget(topic)
                removed.append(topic.name)
            elif retained_ttl > 0:
                retained[topic] = (now, topic.activity())
        period = max(0.0, retained_ttl - ttl)
        while retained and retained_ttl > 0:
            topic = next(iter(retained))
            stamp, mark = retained[topic]
            if stamp + period > now:
                break
            del retained[topic]
            if topic.subs:
                continue
            if topic.activity() == mark:
                self._forget(topic)
                removed.append(topic.name)
            else:  # published to meanwhile: looked at again one period from now
                retained[topic] = (now, topic.activity())
        return removed

    def topic(self, name: str) -> Topic:
        try:
            return self._topics[name]
        except KeyError:
            raise UnknownTopic(f"no topic {name!r}") from None

    def topics(self) -> list[Topic]:
        return list(self._topics.values())

    @property
    def topic_count(self) -> int:
        return len(self._topics)

    def has_topic(self, name: str) -> bool:
        return name in self._topics

    def topic_config(self, name: str) -> TopicConfig | None:
        """The settings the topic has, or would get on first use; None if it neither exists nor matches a rule."""
        topic = self._topics.get(name)
        if topic is not None:
            return topic.config
        return self._rule_for(name)

    def _rule_for(self, name: str) -> TopicConfig | None:
        """The rule's settings for a name no topic has (checked against the name grammar first), from a
        bounded cache: with a broker, every publish to a topic this node does not serve asks (fnmatch over
        every rule, several times per publish)."""
        cache = self._rules_seen
        if name in cache:
            return cache[name]
        check_topic_name(name, self.config.max_topic_name)  # every transport asks this before a new name
        if len(cache) >= RULE_CACHE_MAX:
            cache.clear()
        config = cache[name] = self.config.rule_for(name)
        return config

    def resolve(self, name: str) -> Topic:
        """The topic, created on first use when a config rule matches its name."""
        topic = self._topics.get(name)
        if topic is not None:
            return topic
        config = self._rule_for(name)
        if config is None:
            raise UnknownTopic(f"no topic {name!r} and no rule creates it")
        topic = self.create_topic(name, config)
        topic.auto = True
        self._unused_new[topic] = None  # until someone subscribes
        return topic

    # -- clients ---------------------------------------------------------------------------------------

    def connect(
        self,
        client_id: Hashable,
        *,
        ready: bool = True,
        info: Any = None,
        budget: int | None = None,
        owner: Hashable = None,
        tenant: str = "",
        user: Hashable = None,
        user_weight: float = 1.0,
    ) -> Client:
        """`owner`: whose private queues the client reads (default: the client id itself). With fairness on,
        `tenant` and `user` (default: the owner) are whom its service is counted to (core/fairness.py)."""
        if client_id in self._clients:
            raise CoreUsageError(f"client {client_id!r} is already connected")
        client = Client(client_id, budget or self.config.cycle_budget_bytes, ready, info, owner)
        if self.fair is not None:
            self.fair.join(client, tenant, client.owner if user is None else user, user_weight)
        self._clients[client_id] = client
        return client

    def set_tenant(self, client_id: Hashable, tenant: str, user: Hashable) -> None:
        """With fairness on, the client's service counts to `user` of `tenant` from now on (a connection that
        authenticated after it connected); nothing without. A batch it waits for in its old tenant's line
        still comes from there once."""
        fair = self.fair
        if fair is None:
            return
        client = self.client(client_id)
        fair.leave(client)
        fair.join(client, tenant, user)

    def enable_fairness(self, fair: FairShare) -> None:
        """Serve by tenant, then user (core/fairness.py), from now on; only before any client connects."""
        if self._clients:
            raise CoreUsageError("fairness is chosen before the first client connects")
        self.fair = fair

    def disconnect(self, client_id: Hashable) -> None:
        """Free everything the client held; no trace stays in any topic."""
        client = self._clients.pop(client_id, None)
        if client is None:
            return
        for sub in client.subs.values():
            self._drop_sub(sub)
        client.subs.clear()
        self.direct_bytes -= client.direct_bytes
        client.direct_bytes = 0
        client.direct = None
        client.active.clear()
        client.peeked_subs.clear()
        self._active.pop(client, None)
        if self.fair is not None:  # an entry left in its tenant's deque is dropped when reached
            client.state = ClientState.IDLE
            self.fair.leave(client)

    def attach_sink(self, client_id: Hashable, sink: Sink | None) -> None:
        """Where the client's caught-up one-entry batches may go in a crowd (`crowds`); None: as batches."""
        self.client(client_id).sink = sink

    def client(self, client_id: Hashable) -> Client:
        try:
            return self._clients[client_id]
        except KeyError:
            raise CoreUsageError(f"no client {client_id!r}") from None

    def clients(self) -> list[Client]:
        return list(self._clients.values())

    def has_client(self, client_id: Hashable) -> bool:
        return client_id in self._clients

    def set_owner(self, client_id: Hashable, owner: Hashable) -> None:
        """Change whose private queues the client reads; only while it holds no handle keyed by its owner
        (`Topic.keyed_by_owner`: a private queue)."""
        client = self.client(client_id)
        if any(sub.topic.keyed_by_owner for sub in client.subs.values()):
            raise CoreUsageError(f"client {client_id!r} holds private queues: its owner cannot change")
        client.owner = owner

    def subscribe(
        self,
        client_id: Hashable,
        name: str,
        *,
        since: tuple[str, int] | None = None,
        request_id: Any = None,
        queue_start: tuple[str, int] | None = None,
        ack: bool = False,
        delta: bool | None = None,
    ) -> Subscribed:
        """`queue_start` (private topics, a broker's queue, docs/cluster.md §8): the queue's (epoch, first
        seq) held outside; a new local queue starts at that seq and `subscribed` carries that epoch.
        `ack` (private topics; ignored by shared kinds): entries leave the queue when the client acknowledges
        them (`ack`), not when their batch is written (docs/design/private-queues.md §9).
        `delta`: the client asks for fossil deltas (None: it does not say); granted on topics with
        `delta = "fossil"`, and `subscribed` says whether (core/delta.py)."""
        client = self.client(client_id)
        if name in client.subs:
            raise AlreadySubscribed(f"already subscribed to {name!r}")
        if len(client.subs) >= self.config.max_subscriptions:
            raise TooManySubscriptions(f"at most {self.config.max_subscriptions} subscriptions per client")
        if client.queued() + 2 > self.config.direct_queue_max:
            raise DirectQueueFull("direct queue full")
        self._check_direct_bytes(client, 0)  # `subscribed` and a notice: small, they may pass the bound
        topic = self.resolve(name)
        sub = Subscription(client, topic)
        sub.ack = ack and topic.keyed_by_owner
        sub.delta = bool(delta) and topic.delta_forms is not None
        held = topic.claim(sub)  # private: another connection of the same owner holds the queue
        if held is not None:
            self._take_over(held)
        if queue_start is not None and topic.keyed_by_owner:
            sub.cursor = queue_start[1]  # a new queue starts here; a queue taken over keeps its own cursor
        start, extra = topic.attach(sub, since)
        epoch = topic.epoch_of(sub) if queue_start is None else queue_start[0]
        if topic.keyed_by_owner and since is not None and since[0] != epoch:
            # The queue the recovery point names is gone with what it held: say so (docs/protocol.md `epoch`).
            extra = encode_loss(name, since[1], None, "epoch")
        self._unused_new.pop(topic, None)
        self._unused.pop(topic, None)
        self._retained.pop(topic, None)
        topic.subs[sub] = None
        client.subs[topic.name] = sub  # the topic's own string, not one more per subscriber (`name` is equal)
        self._queue(client, encode_subscribed(name, topic.kind, epoch, start, request_id, None if delta is None else sub.delta))
        if extra is not None:
            self._queue(client, extra)
        if topic.has_data(sub):
            self._activate(sub)
        else:
            self._park(sub)
        self._note_work(client)
        return Subscribed(name, topic.kind, epoch, start)

    def unsubscribe(self, client_id: Hashable, name: str, *, request_id: Any = None) -> None:
        client = self.client(client_id)
        sub = client.subs.pop(name, None)
        if sub is None:
            raise NotSubscribed(f"not subscribed to {name!r}")
        self._drop_sub(sub)
        self.send_direct(client_id, encode_unsubscribed(name, request_id))

    def send_direct(self, client_id: Hashable, entry: bytes) -> None:
        """Queue a priority entry (reply, ack, error); it goes first in the client's next batch."""
        client = self.client(client_id)
        if client.queued() >= self.config.direct_queue_max:
            raise DirectQueueFull(f"direct queue of {client_id!r} holds {self.config.direct_queue_max} entries")
        self._check_direct_bytes(client, len(entry))
        self._queue(client, entry)
        self._note_work(client)

    def _check_direct_bytes(self, client: Client, size: int) -> None:
        """DirectQueueFull when `size` more bytes would take the client's queue past its byte bound, or the
        total past its bound while this client's own queue holds more than a cycle's budget."""
        config = self.config
        held = client.direct_bytes + size
        if held > config.direct_queue_max_bytes:
            raise DirectQueueFull(
                f"direct queue of {client.id!r} would hold {held} bytes (at most {config.direct_queue_max_bytes})"
            )
        if self.direct_bytes + size > config.direct_total_max_bytes and held > client.budget:
            raise DirectQueueFull(
                f"direct queues hold {self.direct_bytes} bytes in all"
                f" (at most {config.direct_total_max_bytes}), {held} of them for {client.id!r}"
            )

    def _queue(self, client: Client, entry: bytes) -> None:
        """Append to the client's direct queue, counting its bytes (every append goes through here)."""
        direct = client.direct
        if direct is None:
            direct = client.direct = deque()
        direct.append(entry)
        size = len(entry)
        client.direct_bytes += size
        self.direct_bytes += size

    # -- publishing ------------------------------------------------------------------------------------

    def publish(self, name: str, data: Any, *, seq: int | None = None, owner: Hashable = None, now: float = 0.0) -> Published:
        """Publish one message. Private topics need `owner`, whose queue it goes to (a client's owner);
        shared topics (ring, snapshot) ignore it: their message goes to every subscriber.

        Raises `RequestError` subclasses: `QueueFull` (back-pressure: wait for `take_space_freed`),
        `DuplicateSeq` / `StaleSeq` / `SkippedSeq` / `BadSeq` (seqs), `NoTarget` / `NotSubscribed` (private:
        no owner, or the owner holds no queue), `UnknownTopic`, `MessageTooLarge`, `BadData`.
        Cost: O(1) plus O(1) per handle it wakes (a shared topic's caught-up subscribers).
        """
        if seq is not None and not 0 <= seq < MAX_SEQ:
            raise BadSeq(f"seq must be in [0, 2**53), not {seq}")
        topic = self.resolve(name)
        seq, woken = topic.publish(data, seq, owner, now)
        if woken and topic.linger:
            self._hold(topic, woken, now)
        elif woken:  # _wake, inlined: this loop is the publish cost per woken handle
            active_clients = self._active
            ready = ClientState.READY
            for sub in woken:
                sub.active = True
                client = sub.client
                client.active[sub] = None
                if client.state is ready and client not in active_clients:
                    active_clients[client] = None
        if topic.pending:  # an attribute, not a call, like `shared` in `_park`
            self._holey[topic] = None
        return Published(name, seq)

    def _hold(self, topic: Topic, woken: Collection[Subscription], now: float) -> None:
        """A topic with a linger keeps the subscribers its publish would wake until `release` (its first
        held publish plus `linger`), so what it publishes meanwhile reaches them together.
        Cost: O(1), plus O(log topics lingering) for the publish that starts a linger."""
        if topic.hold(woken):  # held long enough to risk the ring: wake them now
            self._lingering.pop(topic, None)
            self._wake(topic.take_idle())
        elif topic not in self._lingering:
            deadline = now + topic.linger
            self._lingering[topic] = deadline
            self._holds += 1
            heapq.heappush(self._deadlines, (deadline, self._holds, topic))

    @property
    def lingering(self) -> bool:
        """Whether a topic holds subscribers back (`release` wakes them, from `next_release` on)."""
        return bool(self._lingering)

    def next_release(self) -> float | None:
        """When the earliest linger ends (the clock of `publish`'s `now`). O(1), past ended lingers."""
        deadlines, lingering = self._deadlines, self._lingering
        while deadlines and lingering.get(deadlines[0][2]) != deadlines[0][0]:
            heapq.heappop(deadlines)  # that linger ended early, or its topic is gone
        return deadlines[0][0] if deadlines else None

    def release(self, now: float) -> int:
        """End the lingers due by `now`: wake the subscribers they held. Returns how many ended.
        Cost: O(log(lingers) + subscribers woken) per linger ended."""
        deadlines, lingering = self._deadlines, self._lingering
        ended = 0
        while deadlines and deadlines[0][0] <= now:
            deadline, _, topic = heapq.heappop(deadlines)
            if lingering.get(topic) == deadline:
                del lingering[topic]
                self._wake(topic.take_idle())
                ended += 1
        return ended

    def reserve(self, name: str, count: int) -> tuple[int, int]:
        """Hand out `count` seqs of a ring topic as [begin, end) (docs/design/reorder-window.md §4).

        Raises `CoreUsageError` for another kind, `ValueError` when `count` < 1."""
        return self.resolve(name).reserve(count)

    def tick(self, now: float) -> int:
        """Give up timed-out holes of out-of-order topics. Cost: O(topics with a hole)."""
        moved = 0
        for topic in list(self._holey):
            if topic.expire_hole(now):
                moved += 1
                self._wake(topic.take_idle())
            if not topic.pending:
                del self._holey[topic]
        return moved

    def take_space_freed(self) -> list[tuple[str, Hashable]]:
        """(topic, client) private queues whose refused publishers may retry now (or will get an error)."""
        freed, self._space_freed = self._space_freed, []
        return freed

    # -- readiness and writes --------------------------------------------------------------------------

    def mark_ready(self, client_id: Hashable) -> None:
        client = self.client(client_id)
        client.state = ClientState.READY
        self._note_work(client)

    def mark_idle(self, client_id: Hashable) -> None:
        client = self.client(client_id)
        client.state = ClientState.IDLE
        self._active.pop(client, None)

    def commit(self, client_id: Hashable) -> None:
        """The last batch was written: private entries in it leave their queues (docs/design/private-queues.md §4).

        Cost: O(handles with peeked entries + entries dropped)."""
        client = self.client(client_id)
        for sub in client.peeked_subs:
            if sub.ack:
                continue  # its entries leave when the client acknowledges them (`ack`), not when written
            if sub.topic.commit(sub):
                self._space_freed.append((sub.topic.name, client.owner))
            if self.report_commits:
                head = sub.topic.head(sub)
                if head is not None:
                    self._committed.append((sub.topic.name, client.owner, head))
        client.peeked_subs.clear()

    def ack(self, client_id: Hashable, name: str, seq: int) -> int:
        """The client acknowledged every entry of its subscription `name` (made with `ack`) up to `seq`: they
        leave the queue (and are reported as committed, `take_committed`). An ack below the head does
        nothing. Returns the first seq still queued (everything below it is acknowledged).

        Raises `NotSubscribed`; `BadAck` when the subscription was made without `ack` or `seq` was not
        handed out to it. Cost: O(entries removed)."""
        client = self.client(client_id)
        sub = client.subs.get(name)
        if sub is None:
            raise NotSubscribed(f"not subscribed to {name!r}")
        if not sub.ack:
            raise BadAck(f"the subscription to {name!r} was made without `ack`: its entries need no ack")
        topic = sub.topic
        before = topic.head(sub)
        if topic.ack(sub, seq):
            self._space_freed.append((name, client.owner))
        head = topic.head(sub)
        assert head is not None  # a handle with `ack` holds its queue while subscribed
        if self.report_commits and head != before:
            self._committed.append((name, client.owner, head))
        return head

    def take_committed(self) -> list[tuple[str, Hashable, int]]:
        """With `report_commits` (a broker holds the queues, docs/cluster.md §8): (topic, owner, first seq
        still queued) per private queue a commit shortened since the last call: every seq below it left."""
        committed, self._committed = self._committed, []
        return committed

    def evict(self, name: str, owner: Hashable, reason: str = "taken_over") -> bool:
        """Close the handle holding `owner`'s private queue on `name` (its client gets `closed` with
        `reason`) and free the queue: another node took it over. False when no handle holds it here."""
        topic = self._topics.get(name)
        held = topic.holder(owner) if topic is not None else None
        if held is None:
            return False
        self._take_over(held, reason)
        if held.topic.detach(held):
            self._space_freed.append((name, owner))
        if held.topic.auto and not held.topic.subs:
            self._unused_new[held.topic] = None
        return True

    def rollback(self, client_id: Hashable) -> None:
        """The last batch was not delivered: its private entries are handed out again."""
        client = self.client(client_id)
        for sub in client.peeked_subs:
            if sub.topic.rollback(sub):
                self._activate(sub)
        client.peeked_subs.clear()
        for sub in client.subs.values():  # O(subscriptions): `_fill` lists a handle with `ack` only once
            if sub.ack and sub.peeked and sub.topic.rollback(sub):
                self._activate(sub)

    def write_done(self, client_id: Hashable) -> None:
        self.commit(client_id)
        self.mark_ready(client_id)

    def writes_done(self, client_ids: Iterable[Hashable]) -> None:
        """`write_done` for each client, in one pass: the scheduler's case, where every batch of a cycle that
        was written at once is done (commit and mark_ready inlined; most clients have nothing to commit)."""
        clients = self._clients
        active = self._active
        ready = ClientState.READY
        for client_id in client_ids:
            client = clients[client_id]
            if client.peeked_subs:
                self.commit(client_id)
            client.state = ready
            if (client.direct or client.active) and client not in active:
                active[client] = None

    @property
    def has_work(self) -> bool:
        fair = self.fair
        return bool(self._active) or (fair is not None and bool(fair.active or fair.woken))

    def run_cycle(self) -> list[Batch]:
        """Visit each eligible active client once; return its batch (docs/design/batching.md §5). With
        `crowding`, a client whose batch would be one topic's entry, caught up, with an open sink joins that
        entry's crowd instead (`take_crowds`). With fairness on, tenants and users take their shares
        (`_run_fair_cycle`)."""
        if self.fair is not None:
            return self._run_fair_cycle(self.fair)
        clients, self._active = self._active, {}
        batches: list[Batch] = []
        crowds: list[Crowd] = []
        self.crowds = crowds
        crowding = self.crowding
        # crowds by entry, then variant; the last one joined, which the next client usually joins too
        gathered: dict[bytes, dict[int, Crowd]] = {}
        crowd: Crowd | None = None
        crowded = 0
        counters = self.counters
        counters.cycles += 1
        fill = self._fill
        writing = ClientState.WRITING
        entries = emitted = 0
        for client in clients:
            replies = client.direct is not None  # a client's own entries: never shared, never in a crowd
            out, size = fill(client)
            if out:
                entries += len(out)
                emitted += size
                more = bool(client.active or client.direct)
                sink = client.sink
                if (
                    crowding
                    and sink is not None
                    and sink.open
                    and not more
                    and len(out) == 1
                    and not replies
                    and not client.peeked_subs
                ):
                    entry = out[0]
                    if crowd is None or crowd.entry is not entry or crowd.variant != sink.variant:
                        crowd = self._crowd_of(gathered, crowds, entry, sink.variant)
                    crowd.sinks.append(sink)
                    crowd.tokens.append(sink.token)
                    crowd.handles.append(sink.handle)
                    sink.frames += 1
                    sink.entries += 1
                    sink.bytes += len(entry) + FRAME_OVERHEAD
                    crowded += 1
                    continue
                client.state = writing
                batches.append(Batch(client.id, out, size, more))
        counters.entries_emitted += entries
        counters.bytes_emitted += emitted
        counters.clients_served += len(batches) + crowded
        return batches

    def _run_fair_cycle(self, fair: FairShare) -> list[Batch]:
        """The cycle with tenants and users (core/fairness.py): clients that became ready join their tenant's
        deque; each active tenant, those just woken first, serves clients from the front of its deque within
        its allowance, each client's batch as in the flat cycle (direct queue first, one entry per topic,
        crowds), charged `bytes + frame_cost` to its user and tenant."""
        fair.cycle += 1
        cycle = fair.cycle
        incoming, self._active = self._active, {}
        for client in incoming:
            fair.enqueue(client)
        batches: list[Batch] = []
        crowds: list[Crowd] = []
        self.crowds = crowds
        order = fair.order()
        counters = self.counters
        counters.cycles += 1
        if not order:
            return batches
        vtime = order[0].tag
        weights = 0.0
        for tenant in order:
            if tenant.tag < vtime:
                vtime = tenant.tag
            weights += tenant.weight
        if vtime > fair.vtime:
            fair.vtime = vtime
        window = fair.cycle_target_cost / weights
        alone = len(order) == 1
        frame_cost = fair.frame_cost
        quantum = fair.quantum
        cycle_state = _CycleState(self.crowding)
        ready_state = ClientState.READY
        for tenant in order:
            allowance = float("inf") if alone else (vtime + window - tenant.tag) * tenant.weight
            if allowance <= 0:
                continue  # ahead of the slowest: waits this cycle
            ready = tenant.ready
            spent = 0
            passed: list[Client] = []
            eager: list[User] = []  # users served with more to come
            while ready and spent < allowance:
                client = ready.popleft()
                if client.state is not ready_state or not (client.direct or client.active):
                    client.in_line = False  # stale: no longer ready, or nothing to send
                    continue
                user = client.user
                assert user is not None
                if user.stamp != cycle:
                    user.stamp = cycle
                    user.deficit = min(user.deficit, 0.0) + quantum * user.weight
                    user.passed = False
                if user.deficit <= 0:
                    user.passed = True
                    passed.append(client)
                    continue
                client.in_line = False
                cost, more = self._serve(client, batches, cycle_state, frame_cost, tenant)
                user.deficit -= cost
                spent += cost
                if more:
                    eager.append(user)
            if passed:
                # spare capacity is free: only when everyone served above that will want the next cycle also
                # had clients passed over (a lone user's 20 tabs go out in one cycle; beside others, one turn)
                if spent < allowance and all(user.passed for user in eager):
                    kept: list[Client] = []
                    for client in passed:
                        if spent >= allowance:
                            kept.append(client)
                            continue
                        client.in_line = False
                        cost, _ = self._serve(client, batches, cycle_state, frame_cost, tenant)
                        spent += cost
                    passed = kept
                ready.extendleft(reversed(passed))  # passed over: first in the next cycle
            tenant.tag += spent / tenant.weight
            if ready:
                fair.requeue(tenant)
            else:
                fair.rest(tenant)
        counters.entries_emitted += cycle_state.entries
        counters.bytes_emitted += cycle_state.emitted
        counters.clients_served += len(batches) + cycle_state.crowded
        return batches

    def _serve(
        self, client: Client, batches: list[Batch], state: "_CycleState", frame_cost: int, tenant: Tenant
    ) -> tuple[int, bool]:
        """One client's batch in the fair cycle, as the flat cycle makes it (or its place in a crowd): its
        cost and whether it has more."""
        replies = client.direct is not None
        out, size = self._fill(client)
        if not out:
            return 0, False
        state.entries += len(out)
        state.emitted += size
        more = bool(client.active or client.direct)
        tenant.bytes += size
        tenant.frames += 1
        tenant.entries += len(out)
        cost = size + frame_cost
        tenant.cost += cost
        sink = client.sink
        if (
            state.crowding
            and sink is not None
            and sink.open
            and not more
            and len(out) == 1
            and not replies
            and not client.peeked_subs
        ):
            entry = out[0]
            crowd = state.crowd
            if crowd is None or crowd.entry is not entry or crowd.variant != sink.variant:
                crowd = state.crowd = self._crowd_of(state.gathered, self.crowds, entry, sink.variant)
            crowd.sinks.append(sink)
            crowd.tokens.append(sink.token)
            crowd.handles.append(sink.handle)
            sink.frames += 1
            sink.entries += 1
            sink.bytes += len(entry) + FRAME_OVERHEAD
            state.crowded += 1
            return cost, more
        client.state = ClientState.WRITING
        batches.append(Batch(client.id, out, size, more))
        return cost, more

    def take_crowds(self) -> list[Crowd]:
        """The last cycle's crowds: its clients with an open sink whose batch was one entry, caught up, by
        entry and variant. They stay READY, counted as written (`Sink`): the gateway marks idle one whose
        socket did not take its frame and blocked. Cost: O(1); the cycle gathered them."""
        crowds, self.crowds = self.crowds, []
        return crowds

    @staticmethod
    def _crowd_of(gathered: dict[bytes, dict[int, Crowd]], crowds: list[Crowd], entry: bytes, variant: int) -> Crowd:
        by_variant = gathered.get(entry)
        if by_variant is None:
            by_variant = gathered[entry] = {}
        crowd = by_variant.get(variant)
        if crowd is None:
            crowd = by_variant[variant] = Crowd(entry, variant)
            crowds.append(crowd)
        return crowd

    # -- internals -------------------------------------------------------------------------------------

    def _fill(self, client: Client) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        size = 0
        budget = client.budget
        direct = client.direct
        if direct:
            while direct and size < budget:
                entry = direct.popleft()
                out.append(entry)
                size += len(entry)
            if not direct:  # drained: an idle client holds no queue (`Client.direct`)
                client.direct = None
            client.direct_bytes -= size
            self.direct_bytes -= size
            self.counters.direct_entries += len(out)
        if size >= budget or not client.active:
            return out, size
        handles = client.active  # walked once, then refilled with what stays active, in the order rule's order
        unreached: list[Subscription] | None = None
        again: list[Subscription] | None = None
        peeked = client.peeked_subs
        left = len(handles)
        for sub in handles:
            left -= 1  # handles after this one
            if size >= budget:
                if unreached is None:
                    unreached = []
                unreached.append(sub)
                continue
            topic = sub.topic
            had_peeked = sub.peeked
            room = budget - size
            if topic.auto_depth:  # its share: the handles after it are still reached
                room = -(-room // (left + 1))
            size += topic.read_into(sub, out, room)
            if sub.peeked and not had_peeked:  # entries kept until commit (private): first ones of this batch
                peeked.append(sub)
            if topic.has_data(sub):
                if again is None:
                    again = []
                again.append(sub)
            else:  # _park, inlined: this runs for every handle that runs dry
                sub.active = False
                if topic.shared:
                    topic.idle[sub] = None
        # Handles not reached, then handles still holding data, go before any that become active later (none
        # do during a fill: a read wakes nobody).
        if unreached is None and again is not None and len(again) == len(handles):
            return out, size  # every handle still has data: the same handles in the same order
        handles.clear()
        if unreached is not None:  # usually neither at depth 1: every handle ran dry and was parked
            handles.update(dict.fromkeys(unreached))
        if again is not None:
            handles.update(dict.fromkeys(again))
        return out, size

    def _activate(self, sub: Subscription) -> None:
        if sub.active:
            return
        sub.active = True
        sub.topic.idle.pop(sub, None)
        client = sub.client
        client.active[sub] = None
        if client.state is ClientState.READY and client not in self._active:
            self._active[client] = None

    def _park(self, sub: Subscription) -> None:
        """The handle has nothing to read: a shared topic's next publish wakes it from `idle`; a private
        handle waits nowhere (the publish that fills its queue wakes it)."""
        sub.active = False
        topic = sub.topic
        if topic.shared:  # an attribute, not a call: `_fill` inlines this for every handle that runs dry
            topic.idle[sub] = None

    def _wake(self, woken: Iterable[Subscription]) -> None:
        """Activate parked handles a topic handed over (`Topic.publish`, inlined there; `Topic.take_idle`):
        O(1) each, and nobody else is looked at. They are out of `idle` already and none is active."""
        active_clients = self._active
        ready = ClientState.READY
        for sub in woken:  # _activate, inlined: this loop is the publish cost per idle subscriber
            sub.active = True
            client = sub.client
            client.active[sub] = None
            if client.state is ready and client not in active_clients:
                active_clients[client] = None

    def _note_work(self, client: Client) -> None:
        if client.state is ClientState.READY and client.has_work() and client not in self._active:
            self._active[client] = None

    def _drop_sub(self, sub: Subscription) -> None:
        client = sub.client
        if sub.active:
            client.active.pop(sub, None)
            sub.active = False
        topic = sub.topic
        topic.subs.pop(sub, None)
        if sub in client.peeked_subs:
            client.peeked_subs.remove(sub)
        if topic.detach(sub):  # a refused publisher waited on this queue: it retries and gets an error
            self._space_freed.append((topic.name, client.owner))
        if topic.auto and not topic.subs:
            self._unused_new[topic] = None

    def _take_over(self, old: Subscription, reason: str = "taken_over") -> None:
        """Hand what `old` holds (a private queue) to a new handle, `Topic.claim` having named it: the old
        handle leaves its client (which gets `closed` with reason `taken_over`) and the topic's sets, but the
        topic does not `detach` it, so its state stays for `attach` to adopt."""
        client = old.client
        topic = old.topic
        del client.subs[topic.name]
        if old.active:
            client.active.pop(old, None)
            old.active = False
        if old in client.peeked_subs:
            client.peeked_subs.remove(old)
        topic.subs.pop(old, None)
        topic.idle.pop(old, None)
        self._queue(client, encode_closed(topic.name, reason))  # past the bound, like delete_topic
        self._note_work(client)


class _CycleState:
    """What one fair cycle gathers across its tenants (`Engine._run_fair_cycle`)."""

    __slots__ = ("crowding", "gathered", "crowd", "crowded", "entries", "emitted")

    def __init__(self, crowding: bool) -> None:
        self.crowding = crowding
        #: crowds by entry, then variant; the last one joined, which the next client usually joins too
        self.gathered: dict[bytes, dict[int, Crowd]] = {}
        self.crowd: Crowd | None = None
        self.crowded = 0
        self.entries = 0
        self.emitted = 0
