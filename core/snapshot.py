"""Snapshot topics: shared, last value only (docs/design/batching.md §7).

Only the latest message is kept, with its seq, so a client can tell how many updates were conflated (a seq
jump is conflation, not loss). A new subscriber gets the latest at once through its direct queue (state of
the world); a subscriber that fell behind gets only the latest.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any, ClassVar

from .client import Subscription
from .errors import StaleSeq
from .topics import Topic


class SnapshotTopic(Topic):
    kind: ClassVar[str] = "snapshot"
    latest: bytes | None = None
    #: seq of `latest`; the next publish gets seq + 1
    seq = -1
    #: the value before `latest` when its seq is `seq - 1` (the base of a delta, core/delta.py), else None
    previous: bytes | None = None

    def publish(self, data: Any, seq: int | None, owner: Hashable, now: float) -> tuple[int, Collection[Subscription]]:
        """Replace the latest value. Returns (seq, the caught-up subscribers). `owner` is ignored."""
        if seq is not None and seq <= self.seq:
            # Last value wins by seq: an older update arriving late must not replace a newer one.
            raise StaleSeq(f"seq {seq} of {self.name!r} is not after the latest {self.seq}")
        new_seq = self.seq + 1 if seq is None else seq
        latest = self.encode(new_seq, data)
        if self.delta_forms is not None:
            self.previous = self.latest if new_seq == self.seq + 1 else None
        self.latest = latest
        self.seq = new_seq
        self.counters.messages_published += 1
        if not self.idle:
            return new_seq, ()
        woken, self.idle = self.idle, {}  # `take_idle`, inlined: the publish hot path
        return new_seq, woken

    def restart(self, epoch: str, start: int) -> None:
        """No value, epoch `epoch`; the next publish may take any seq from `start` on."""
        self.epoch = epoch
        self.latest = self.previous = None
        self.seq = start - 1

    def skip_to(self, upto: int, now: float) -> bool:
        return False  # last value only: a seq jump is conflation, never a loss

    def attach(self, sub: Subscription, since: tuple[str, int] | None) -> tuple[int, bytes | None]:
        sub.cursor = self.seq + 1
        sub.base = -1
        if self.latest is None:
            return sub.cursor, None
        if since is not None and since[0] == self.epoch and since[1] > self.seq:
            return sub.cursor, None  # the client already has the latest value
        self.counters.messages_delivered += 1
        return self.seq, self._form(sub, self.latest)

    def has_data(self, sub: Subscription) -> bool:
        return sub.cursor <= self.seq

    def retains_data(self) -> bool:
        return self.latest is not None

    def activity(self) -> int:
        return self.seq

    def read_into(self, sub: Subscription, out: list[bytes], room: int) -> int:
        if sub.cursor > self.seq or self.latest is None:
            return 0
        latest = self._form(sub, self.latest)
        out.append(latest)
        sub.cursor = self.seq + 1
        self.counters.messages_delivered += 1
        return len(latest)

    def _form(self, sub: Subscription, latest: bytes) -> bytes:
        """What `sub` gets of the latest value: a delta subscriber its delta form (core/delta.py)."""
        forms = self.delta_forms
        if forms is None or not sub.delta:
            return latest
        return forms.entry_for(sub, self.seq, latest, self.previous, self.seq - 1)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "seq": self.seq}
