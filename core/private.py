"""Private topics: one queue per subscribed client, not lossy (docs/design/private-queues.md).

A queue is bounded in count and bytes. A publish into a full queue raises `QueueFull` (back-pressure): the
publisher waits, and the engine reports the queue in `take_space_freed` the moment a commit frees space.
Reading is split in two (docs/design/private-queues.md §4): `read_into` hands entries out (Next) without removing them, counted
in `sub.peeked`; the engine's `commit` removes them once written (Shift), `rollback` hands them out again.
A handle subscribed with `ack` (§9) is committed by the client's acknowledgement (`ack`) instead of the write.
A queue belongs to an owner (the user); a new handle of the same owner takes it over (`claim`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Hashable
from typing import Any, ClassVar

from .client import Subscription
from .config import TopicConfig
from .counters import Counters
from .errors import BadAck, BadSeq, NoTarget, NotSubscribed, QueueFull, StaleSeq
from .topics import Topic


class PrivateTopic(Topic):
    kind: ClassVar[str] = "private"
    keyed_by_owner: ClassVar[bool] = True

    def __init__(self, name: str, epoch: str, config: TopicConfig, counters: Counters) -> None:
        super().__init__(name, epoch, config, counters)
        self.shared = False  # each handle has its own queue: the publish that fills it wakes it alone
        #: the handle holding each owner's queue
        self.queues: dict[Hashable, Subscription] = {}
        #: each queue's own epoch: a queue dropped with its entries (its holder left) and made again starts
        #: at seq 0 in a new epoch, so a `since` of the old one gets an `epoch` loss notice, never silence
        self.queue_epochs: dict[Hashable, str] = {}
        self._queues_made = 0

    def claim(self, sub: Subscription) -> Subscription | None:
        """The handle holding the queue of `sub`'s owner, if any: `attach` moves the queue to `sub`."""
        return self.queues.get(sub.client.owner)

    def attach(self, sub: Subscription, since: tuple[str, int] | None) -> tuple[int, bytes | None]:
        """A queue belongs to an owner (the user). A new handle of the same owner takes the queue over: the
        engine has already detached the old handle from its client; entries it was handed and did not
        commit are handed out again (at-least-once across a takeover; seqs tell duplicates)."""
        owner = sub.client.owner
        previous = self.queues.get(owner)
        if previous is not None:
            queue = previous.queue
            assert queue is not None  # a handle in `queues` holds the queue (attach / detach)
            sub.queued_bytes, sub.cursor, sub.waiting = previous.queued_bytes, previous.cursor, previous.waiting
            previous.queue = None
        else:
            queue = deque()
            sub.queued_bytes = 0
            self._queues_made += 1
            self.queue_epochs[owner] = f"{self.epoch}.{self._queues_made}"
        sub.queue = queue
        sub.peeked = 0
        self.queues[owner] = sub
        return sub.cursor - len(queue), None

    def holder(self, owner: Hashable) -> Subscription | None:
        return self.queues.get(owner)

    def head(self, sub: Subscription) -> int | None:
        return None if sub.queue is None else sub.cursor - len(sub.queue)

    def epoch_of(self, sub: Subscription) -> str:
        return self.queue_epochs.get(sub.client.owner, self.epoch)

    def detach(self, sub: Subscription) -> bool:
        super().detach(sub)
        owner = sub.client.owner
        if self.queues.get(owner) is sub:
            del self.queues[owner]
            self.queue_epochs.pop(owner, None)
        sub.queue = None
        return sub.waiting

    def retains_data(self) -> bool:
        return bool(self.queues)

    def activity(self) -> int:
        return 0  # a queue lives with its handle: an unused private topic retains nothing

    def publish(self, data: Any, seq: int | None, owner: Hashable, now: float) -> tuple[int, Collection[Subscription]]:
        """Queue one message for `owner`'s handle. Returns (seq, the handle if it was parked, else ()): an
        active handle reads the entry when it is next served."""
        if owner is None:
            raise NoTarget(f"private topic {self.name!r} needs the user whose queue gets the message (`client`)")
        sub = self.queues.get(owner)
        if sub is None:
            raise NotSubscribed(f"{owner!r} has no queue on {self.name!r}")
        queue = sub.queue
        assert queue is not None  # a handle in `queues` holds the queue (attach / detach)
        if seq is not None and seq != sub.cursor:
            # A private queue is filled in order by one producer: a seq only makes a retry idempotent.
            if seq < sub.cursor:
                raise StaleSeq(f"seq {seq} of private {self.name!r} was already queued")
            raise BadSeq(f"seq {seq} of private {self.name!r} is not the next one ({sub.cursor})")
        entry = self.encode(sub.cursor, data)
        config = self.config
        if len(queue) >= config.max_count or (queue and sub.queued_bytes + len(entry) > config.max_bytes):
            sub.waiting = True
            self.counters.back_pressure_events += 1
            raise QueueFull(f"private queue {self.name!r} of {sub.client.owner!r} is full")
        queue.append(entry)
        sub.queued_bytes += len(entry)
        seq = sub.cursor
        sub.cursor += 1
        self.counters.messages_published += 1
        if sub.active:
            return seq, ()
        return seq, (sub,)

    def has_data(self, sub: Subscription) -> bool:
        return sub.queue is not None and sub.peeked < len(sub.queue)

    def read_into(self, sub: Subscription, out: list[bytes], room: int) -> int:
        queue = sub.queue
        if queue is None:
            return 0
        added = 0
        taken = 0
        depth: int = self.config.batch_depth  # type: ignore[assignment]  # TopicConfig refuses "auto" here
        while taken < depth and sub.peeked < len(queue) and added < room:
            entry = queue[sub.peeked]
            out.append(entry)
            added += len(entry)
            sub.peeked += 1
            taken += 1
        self.counters.messages_delivered += taken
        return added

    def commit(self, sub: Subscription) -> bool:
        """Remove the handed-out entries. Returns whether a waiting publisher should be woken."""
        if sub.queue is None:
            return False
        return self._shift(sub, sub.peeked)

    def _shift(self, sub: Subscription, count: int) -> bool:
        """Remove the first `count` handed-out entries of `sub`'s queue. Returns whether a waiting publisher
        should be woken (the queue is below its bound again)."""
        queue = sub.queue
        assert queue is not None
        for _ in range(count):
            sub.queued_bytes -= len(queue.popleft())
        sub.peeked -= count
        if sub.waiting and len(queue) < self.config.max_count:
            sub.waiting = False
            return True
        return False

    def ack(self, sub: Subscription, seq: int) -> bool:
        """Remove the entries up to `seq` the client acknowledged (a handle with `sub.ack`, whose commits remove
        nothing). Below the head: nothing to do; past what was handed out: `BadAck`. Returns whether a
        waiting publisher should be woken."""
        queue = sub.queue
        if queue is None:
            return False
        head = sub.cursor - len(queue)
        count = seq - head + 1
        if count <= 0:
            return False  # acknowledged already (cumulative acks)
        if count > sub.peeked:
            raise BadAck(f"seq {seq} of private {self.name!r} was not delivered (delivered up to {head + sub.peeked - 1})")
        return self._shift(sub, count)

    def rollback(self, sub: Subscription) -> bool:
        """Hand the peeked entries out again (the engine activates the handle)."""
        if sub.queue is None:
            return False
        sub.peeked = 0
        return True

    def info(self) -> dict[str, Any]:
        return {**super().info(), "queued": sum(len(s.queue or ()) for s in self.queues.values())}
