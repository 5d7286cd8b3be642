"""Private topics: one queue per subscribed client, not lossy (seeds 001 and 002).

A queue is bounded in count and bytes. A publish into a full queue raises `QueueFull` (back-pressure): the
publisher waits, and the engine reports the queue in `take_space_freed` the moment a commit frees space.
Reading is split in two as in seed 001: `read_into` hands entries out (Next) without removing them; the
engine's `commit` removes them once written (Shift), `rollback` hands them out again.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .client import Subscription
from .errors import BadSeq, QueueFull, StaleSeq
from .topics import Topic


class PrivateTopic(Topic):
    kind = "private"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queues: dict[Any, Subscription] = {}

    def attach(self, sub: Subscription, since: tuple[str, int] | None) -> tuple[int, bytes | None]:
        """A queue belongs to an owner (the user). A new handle of the same owner takes the queue over: the
        engine has already detached the old handle from its client; entries it was handed and did not
        commit are handed out again (at-least-once across a takeover; seqs tell duplicates)."""
        owner = sub.client.owner
        previous = self.queues.get(owner)
        if previous is not None:
            sub.queue, sub.queued_bytes, sub.cursor, sub.waiting = (
                previous.queue, previous.queued_bytes, previous.cursor, previous.waiting)
            previous.queue = None
        else:
            sub.queue = deque()
            sub.queued_bytes = 0
        sub.peeked = 0
        self.queues[owner] = sub
        return sub.cursor - len(sub.queue), None

    def detach(self, sub: Subscription) -> None:
        super().detach(sub)
        owner = sub.client.owner
        if self.queues.get(owner) is sub:
            del self.queues[owner]
        sub.queue = None

    def retains_data(self) -> bool:
        return bool(self.queues)

    def publish_to(self, sub: Subscription, data: Any, seq: int | None) -> int:
        queue = sub.queue
        assert queue is not None
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
        return seq

    def has_data(self, sub: Subscription) -> bool:
        return sub.queue is not None and sub.peeked < len(sub.queue)

    def read_into(self, sub: Subscription, out: list[bytes], room: int) -> int:
        queue = sub.queue
        if queue is None:
            return 0
        added = 0
        taken = 0
        depth = self.config.batch_depth
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
        queue = sub.queue
        if queue is None:
            return False
        for _ in range(sub.peeked):
            sub.queued_bytes -= len(queue.popleft())
        sub.peeked = 0
        if sub.waiting and len(queue) < self.config.max_count:
            sub.waiting = False
            return True
        return False

    def rollback(self, sub: Subscription) -> None:
        sub.peeked = 0

    def info(self) -> dict[str, Any]:
        return {**super().info(), "queued": sum(len(s.queue or ()) for s in self.queues.values())}
