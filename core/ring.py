"""Ring topics: shared, queued, lossy (docs/design/shared-rings.md), with out-of-order publishing
(docs/design/reorder-window.md).

Messages are stored once in a ring of `capacity` slots; a subscriber holds only a cursor. Sequence numbers
increase from 0 within the topic's epoch. The available range is the half-open [begin, end): `end` is the
first seq not yet available, `begin` the oldest still retained (end - begin <= capacity).

Out-of-order producers publish explicit seqs in any order within `reorder_window` of `end`. Arrivals past
`end` wait in `pending`; `available` is the bitmap (bit i: seq end + i has arrived), so the contiguous
prefix is found with one bit trick. A hole is given up, and announced to subscribers as a loss notice,
when a seq >= hole + window arrives or when it has been open for `hole_timeout` (engine `tick`): a hole is
open from the first arrival past it. A given-up seq is kept in the ring as `None`, and the given-up ranges
are remembered (the last `MAX_LOST_RANGES`), so each subscriber learns the exact range it will never see
and why, and a late retry of a given-up seq is told `skipped_seq` (lost), never `stale_seq` (landed).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Hashable
from typing import Any, ClassVar

from .client import Subscription
from .config import AUTO_MAX_SLICE, AUTO_MAX_SPAN, MAX_SEQ, TopicConfig
from .counters import Counters
from .entries import encode_loss
from .errors import BadSeq, DuplicateSeq, SkippedSeq, StaleSeq
from .topics import Topic

#: Given-up ranges remembered per topic (two ints each): older ones are forgotten, and a retry of a seq in
#: them is then answered `stale_seq`. 4096 covers hours of a lossy producer at a hole a second.
MAX_LOST_RANGES = 4096


def _trailing_ones(bits: int) -> int:
    return (bits ^ (bits + 1)).bit_length() - 1


class RingTopic(Topic):
    kind: ClassVar[str] = "ring"

    def __init__(self, name: str, epoch: str, config: TopicConfig, counters: Counters) -> None:
        super().__init__(name, epoch, config, counters)
        self.capacity = config.capacity
        self.slots: list[bytes | None] = [None] * config.capacity
        self.begin = 0
        self.end = 0
        #: next id `reserve` hands out (docs/design/reorder-window.md §4): never below end
        self.next_id = 0
        # `pending` (declared on Topic, which the engine reads): arrivals past `end`, by seq
        self.available = 0
        #: when each pending seq arrived: the hole at `end` is open since the earliest of them
        self.arrived: dict[int, float] = {}
        #: when the hole at `end` was first seen (pending non-empty), for the timeout
        self.hole_since: float | None = None
        #: given-up ranges [lost_begins[i], lost_ends[i]), ascending and disjoint
        self.lost_begins: list[int] = []
        self.lost_ends: list[int] = []

    # -- producers ---------------------------------------------------------------------------------------

    def reserve(self, count: int) -> tuple[int, int]:
        """Hand out `count` ids as [begin, end) for producers that publish them later, in any order."""
        if count < 1:
            raise ValueError("count must be >= 1")
        if self.next_id + count > MAX_SEQ:
            raise BadSeq(f"reserving {count} seqs of {self.name!r} would pass 2**53")
        first = self.next_id
        self.next_id += count
        return first, self.next_id

    def publish(self, data: Any, seq: int | None, owner: Hashable, now: float) -> tuple[int, Collection[Subscription]]:
        """Store one message. Returns (seq, the caught-up subscribers if `end` moved, else ()).

        `owner` is ignored: every subscriber reads the ring."""
        if seq is None:
            seq = self.next_id
        elif seq < self.end:
            if self._given_up(seq):
                raise SkippedSeq(f"seq {seq} of {self.name!r} arrived after its hole was given up (announced as lost)")
            raise StaleSeq(f"seq {seq} of {self.name!r} is below the available end {self.end}")
        elif seq in self.pending:
            raise DuplicateSeq(f"seq {seq} of {self.name!r} was already published")
        entry = self.encode(seq, data)  # before taking the seq: a refused message must leave no hole
        if seq >= self.next_id:
            self.next_id = seq + 1
        self.counters.messages_published += 1
        end_before = self.end
        window = self.config.reorder_window
        if seq >= self.end + window:
            self._give_up_before(seq - window + 1, now)
        if seq == self.end:
            self._append(entry)
            self._take_contiguous(now)
        else:
            self.pending[seq] = entry
            self.arrived[seq] = now
            self.available |= 1 << (seq - self.end)
            if self.hole_since is None:
                self.hole_since = now
        if self.end == end_before or not self.idle:
            return seq, ()
        woken, self.idle = self.idle, {}  # `take_idle`, inlined: the publish hot path
        return seq, woken

    def hold(self, woken: Collection[Subscription]) -> bool:
        """Also ends the linger once the most-behind held subscriber is half a ring behind, so a linger
        never pushes a caught-up subscriber off the ring. The first handle in `idle` parked first, with the
        lowest cursor: parked handles were caught up, and the end only moves forward."""
        super().hold(woken)
        return self.end - next(iter(self.idle)).cursor >= max(1, self.capacity // 2)

    def restart(self, epoch: str, start: int) -> None:
        """Empty ring in epoch `epoch`, available range [start, start): a broker's stream position."""
        if not 0 <= start < MAX_SEQ:
            raise BadSeq(f"start seq must be in [0, 2**53), not {start}")
        self.epoch = epoch
        self.slots = [None] * self.capacity
        self.begin = self.end = self.next_id = start
        self.pending.clear()
        self.arrived.clear()
        self.available = 0
        self.hole_since = None
        self.lost_begins.clear()
        self.lost_ends.clear()

    def skip_to(self, upto: int, now: float) -> bool:
        """[end, upto) will never arrive: subscribers read it as `loss` `skipped`, the exact range."""
        if upto <= self.end:
            return False
        self.next_id = max(self.next_id, upto)
        self._give_up_before(upto, now)
        return True

    def expire_hole(self, now: float) -> bool:
        """Give up every hole open for `hole_timeout` or longer. Returns whether `end` moved."""
        moved = False
        timeout = self.config.hole_timeout
        while self.pending and self.hole_since is not None and now - self.hole_since >= timeout:
            self._give_up_before(min(self.pending), now)
            moved = True
        return moved

    def _append(self, entry: bytes | None) -> None:
        self.slots[self.end % self.capacity] = entry
        self.end += 1
        self.available >>= 1
        if self.end - self.begin > self.capacity:
            self.begin = self.end - self.capacity

    def _take_contiguous(self, now: float) -> None:
        run = _trailing_ones(self.available)
        for _ in range(run):
            del self.arrived[self.end]
            self._append(self.pending.pop(self.end))
        if not self.pending:
            self.hole_since = None
        elif run:
            # A new hole is at `end` now: it has been open since the first arrival past it, so k holes
            # noticed together are all given up after one timeout, not k of them.
            self.hole_since = min(self.arrived.values())

    def _give_up_before(self, target: int, now: float) -> None:
        """Move `end` to `target`, storing what arrived and marking the holes as lost."""
        jump_to = target - self.capacity
        if jump_to > self.end:
            # Only the last `capacity` seqs can stay in the ring: jump over the rest without a loop. What
            # arrived there is dropped with it (subscribers are told `lagged`), the holes are `skipped`.
            arrived = sorted(s for s in self.pending if s < jump_to)
            start = self.end
            for s in arrived:
                del self.pending[s]
                del self.arrived[s]
                self._note_lost(start, s)
                start = s + 1
            self._note_lost(start, jump_to)
            self.counters.holes_skipped += jump_to - self.end - len(arrived)
            self.available >>= jump_to - self.end
            self.end = jump_to
            self.begin = max(self.begin, self.end - self.capacity)
        while self.end < target:
            entry = self.pending.pop(self.end, None)
            if entry is None:
                self.counters.holes_skipped += 1
                self._note_lost(self.end, self.end + 1)
            else:
                del self.arrived[self.end]
            self._append(entry)
        self._take_contiguous(now)

    def _note_lost(self, begin: int, end: int) -> None:
        """Remember [begin, end) as given up (merged with the previous range when they touch)."""
        if begin >= end:
            return
        if self.lost_ends and self.lost_ends[-1] == begin:
            self.lost_ends[-1] = end
            return
        self.lost_begins.append(begin)
        self.lost_ends.append(end)
        if len(self.lost_begins) > MAX_LOST_RANGES:
            del self.lost_begins[0], self.lost_ends[0]

    def stored(self, seq: int) -> bytes | None:
        """The entry of `seq` while the ring retains it; None outside [begin, end) or for a seq given up."""
        if not self.begin <= seq < self.end:
            return None
        return self.slots[seq % self.capacity]

    def retains_all_from(self, seq: int) -> bool:
        """Whether every seq from `seq` to the end is retained and none of them was given up: a recovery
        from `seq` would be complete."""
        if not self.begin <= seq <= self.end:
            return False
        i = bisect.bisect_right(self.lost_ends, seq)  # the first given-up range that ends past `seq`
        return i == len(self.lost_begins) or self.lost_begins[i] >= self.end

    def _given_up(self, seq: int) -> bool:
        i = bisect.bisect_right(self.lost_begins, seq) - 1
        return i >= 0 and seq < self.lost_ends[i]

    # -- subscribers -------------------------------------------------------------------------------------

    def attach(self, sub: Subscription, since: tuple[str, int] | None) -> tuple[int, bytes | None]:
        sub.base = -1  # the first message after a (re)attach goes whole
        if since is None:
            sub.cursor = self.end
            return self.end, None
        epoch, seq = since
        if epoch != self.epoch:
            # The recovery point is in another epoch: its range there is unknown, so `to` is null.
            sub.cursor = self.begin
            self.counters.loss_notices += 1
            return self.begin, encode_loss(self.name, seq, None, "epoch")
        if seq < self.begin:
            sub.cursor = self.begin
            self.counters.loss_notices += 1
            self.counters.messages_lost += self.begin - seq
            return self.begin, encode_loss(self.name, seq, self.begin, "gone")
        sub.cursor = min(seq, self.end)
        return sub.cursor, None

    def has_data(self, sub: Subscription) -> bool:
        return sub.cursor < self.end

    def retains_data(self) -> bool:
        # Any seq handed out (published, pending or reserved) is history a recovery may ask for.
        return self.next_id > 0 or self.end > 0 or bool(self.pending)

    def activity(self) -> int:
        return self.end + self.next_id + len(self.pending)

    def read_into(self, sub: Subscription, out: list[bytes], room: int) -> int:
        depth = self.config.batch_depth
        if depth == 1:  # the default: one stored entry when there is one, else the general path below
            cursor = sub.cursor
            if self.begin <= cursor < self.end:
                entry = self.slots[cursor % self.capacity]
                if entry is not None:
                    if sub.delta:
                        entry = self._delta_entry(sub, cursor, entry)
                    out.append(entry)
                    sub.cursor = cursor + 1
                    self.counters.messages_delivered += 1
                    return len(entry)
        elif isinstance(depth, str):  # AUTO_DEPTH, the only string TopicConfig keeps
            return self._read_auto(sub, out, room)
        added = 0
        taken = 0
        slots = self.slots
        capacity = self.capacity
        while taken < depth and sub.cursor < self.end and added < room:
            cursor = sub.cursor
            if cursor < self.begin:
                added += self._emit_behind(out, cursor, self.begin)
                sub.cursor = self.begin
                continue
            entry = slots[cursor % capacity]
            if entry is None:
                stop = cursor + 1
                while stop < self.end and slots[stop % capacity] is None:
                    stop += 1
                added += self._emit_loss(out, cursor, stop, "skipped")
                sub.cursor = stop
                continue
            if sub.delta:
                entry = self._delta_entry(sub, cursor, entry)
            out.append(entry)
            added += len(entry)
            sub.cursor = cursor + 1
            taken += 1
        self.counters.messages_delivered += taken
        return added

    def _read_auto(self, sub: Subscription, out: list[bytes], room: int) -> int:
        """`batch_depth = "auto"` (docs/design/batching.md §8): a slice sized by the backlog.

        A subscriber one message behind (caught up) gets one, as at depth 1; one `lag` behind gets
        ceil(lag x AUTO_MAX_SLICE / span) (span: the capacity, at most AUTO_MAX_SPAN), at most AUTO_MAX_SLICE,
        so it reaches the bound before the ring wraps under it. `room` is the handle's share of what is left
        of the client's budget (the engine's `_fill`): as at any depth an entry goes while fewer than `room`
        bytes were added (so the first always goes), but a message after the first only if it fits in
        `room`: the handles after this one in the cycle are still reached. Loss notices do not count in the
        slice. Cost: O(entries emitted).
        """
        cursor = sub.cursor
        end = self.end
        span = min(self.capacity, AUTO_MAX_SPAN)
        depth = min(AUTO_MAX_SLICE, -(-(end - cursor) * AUTO_MAX_SLICE // span))
        added = 0
        taken = 0
        slots = self.slots
        capacity = self.capacity
        while taken < depth and cursor < end and added < room:
            if cursor < self.begin:
                added += self._emit_behind(out, cursor, self.begin)
                cursor = self.begin
                continue
            entry = slots[cursor % capacity]
            if entry is None:
                stop = cursor + 1
                while stop < end and slots[stop % capacity] is None:
                    stop += 1
                added += self._emit_loss(out, cursor, stop, "skipped")
                cursor = stop
                continue
            if taken and added + len(entry) > room:
                break
            if sub.delta:
                entry = self._delta_entry(sub, cursor, entry)
            out.append(entry)
            added += len(entry)
            cursor += 1
            taken += 1
        sub.cursor = cursor
        self.counters.messages_delivered += taken
        return added

    def _delta_entry(self, sub: Subscription, seq: int, entry: bytes) -> bytes:
        """The form a delta subscriber gets (core/delta.py): a delta of the message before when it read it."""
        forms = self.delta_forms
        if forms is None:
            return entry
        previous = self.slots[(seq - 1) % self.capacity] if seq > self.begin else None
        return forms.entry_for(sub, seq, entry, previous, self.begin)

    def _emit_behind(self, out: list[bytes], cursor: int, begin: int) -> int:
        """Loss notices for [cursor, begin), seqs that left the ring before the subscriber read them: the
        given-up parts are `skipped` (never published), the rest `lagged` (published, overwritten)."""
        added = 0
        begins, ends = self.lost_begins, self.lost_ends
        i = max(0, bisect.bisect_right(begins, cursor) - 1)
        while cursor < begin:
            if i < len(begins) and begins[i] < begin:
                lost_begin, lost_end = begins[i], ends[i]
                i += 1
                if lost_end <= cursor:
                    continue
                if lost_begin > cursor:
                    added += self._emit_loss(out, cursor, lost_begin, "lagged")
                    cursor = lost_begin
                stop = min(lost_end, begin)
                added += self._emit_loss(out, cursor, stop, "skipped")
                cursor = stop
            else:
                added += self._emit_loss(out, cursor, begin, "lagged")
                cursor = begin
        return added

    def _emit_loss(self, out: list[bytes], begin: int, end: int, reason: str) -> int:
        entry = encode_loss(self.name, begin, end, reason)
        out.append(entry)
        self.counters.loss_notices += 1
        self.counters.messages_lost += end - begin
        return len(entry)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "begin": self.begin, "end": self.end, "pending": len(self.pending)}
