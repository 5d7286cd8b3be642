"""History as Centrifugo answers it, read from a topic this node holds (docs/centrifugo.md).

A publication's offset is its seq + 1, so the stream position (`offset`) is the offset of the newest
publication, 0 before the first. `limit` 0 asks for the position only, -1 for everything retained, N for N
publications: the oldest N, or with `reverse` the newest N, newest first. `since` {offset, epoch} asks for
the publications after it (with `reverse`: before it). Stricter than Centrifugo, which answers what is left:
when some publication after `since` has left the ring the answer is error 112 (unrecoverable position),
never a list with a hole the caller could not see.

An answer is read as rows (offset, the data's JSON text cut out of the stored entry, never parsed), which
each caller writes in its own form in one join: 10,000 publications in a few milliseconds, where a parse and
an encode of each took 20-50. Its size is bounded by a `HistoryBudget` (publications and bytes), which a
caller shares between the answers of one request (a server-API `batch`) or sizes to what it can queue (a
client's direct queue): an answer is cut where the budget ends, and the caller pages on with `since`.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.entries import DATA_KEY, MSG_HEAD
from core.ring import RingTopic
from core.snapshot import SnapshotTopic
from core.topics import Topic

from .api_errors import NOT_AVAILABLE, UNRECOVERABLE_POSITION, ApiError, bad_request

#: publications one answer holds at most, whatever `limit` asks (a caller pages on with `since`)
MAX_PUBLICATIONS = 10_000
#: and at most this many bytes of message data (the first always goes): an answer of ring capacity x 1 MiB
#: messages is never built in one turn of the event loop; also what one server-API call answers in all
MAX_BYTES = 8 << 20

#: one publication of an answer: its offset (seq + 1) and its data's JSON text
Row = tuple[int, bytes]


class HistoryBudget:
    """What answers may still hold: publications, and bytes of data plus `row_cost` per publication. With
    `first_always` an answer takes at least one publication while any budget is left (a message larger than
    the bytes left still goes, as the first of an answer); without, nothing goes past the bytes."""

    __slots__ = ("publications", "bytes", "row_cost", "first_always")

    def __init__(
        self, publications: int = MAX_PUBLICATIONS, size: int = MAX_BYTES, *, row_cost: int = 0, first_always: bool = True
    ) -> None:
        self.publications = publications
        self.bytes = size
        self.row_cost = row_cost
        self.first_always = first_always

    @property
    def spent(self) -> bool:
        return self.publications <= 0 or self.bytes <= 0


@dataclass(frozen=True, slots=True)
class HistoryQuery:
    limit: int
    #: (offset, epoch) of the caller's position, or None
    since: tuple[int, str] | None
    reverse: bool

    def check(self) -> None:
        if self.limit < -1:
            raise bad_request(f"limit must be -1 (all), 0 (position only) or positive, not {self.limit}")
        if self.since is not None and self.since[0] < 0:
            raise bad_request(f"since.offset must be >= 0, not {self.since[0]}")
        if self.reverse and self.since is not None and self.since[0] == 0:
            raise bad_request("since.offset 0 with reverse: there is nothing before offset 0")

    @property
    def count(self) -> int:
        return MAX_PUBLICATIONS if self.limit == -1 else min(self.limit, MAX_PUBLICATIONS)


@dataclass(frozen=True, slots=True)
class History:
    """An answer: its publications in answer order, the stream position and epoch."""

    rows: list[Row]
    offset: int
    epoch: str


def position_only(offset: int, epoch: str) -> History:
    return History([], offset, epoch)


def read(topic: Topic, query: HistoryQuery, budget: HistoryBudget | None = None) -> History:
    """The history of a ring or snapshot topic, within `budget` (taken from it; a fresh one when None)."""
    reading = HistoryRead(topic, query, budget or HistoryBudget())
    while not reading.step(MAX_PUBLICATIONS):
        pass
    return reading.answer


class HistoryRead:
    """One answer, read a slice at a time (`step`): a connection's history takes turns of the event loop
    with the other clients' work. Each slice reads the ring as it is then: where the next publication has
    left it meanwhile (a laggard's oldest), the answer ends there, complete up to it, and the caller pages
    on with `since` (and learns with 112 what left). The checks that refuse a query are made at once."""

    __slots__ = ("topic", "seqs", "at", "count", "budget", "size", "rows", "offset", "epoch", "done")

    def __init__(self, topic: Topic, query: HistoryQuery, budget: HistoryBudget) -> None:
        if isinstance(topic, RingTopic):
            top, first = topic.end, topic.begin
        elif isinstance(topic, SnapshotTopic):
            top, first = topic.seq + 1, topic.seq  # one publication retained: the latest
        else:
            raise ApiError(NOT_AVAILABLE, f"topic {topic.name[:256]!r} is a private queue: no history")
        since = query.since
        if since is not None and since[1] and since[1] != topic.epoch:
            raise ApiError(UNRECOVERABLE_POSITION, f"since.epoch {since[1][:64]!r} is not the topic's {topic.epoch!r}")
        self.topic = topic
        self.offset, self.epoch = top, topic.epoch
        self.rows: list[Row] = []
        self.seqs = range(0) if query.limit == 0 else _wanted(top, max(first, 0), query, isinstance(topic, SnapshotTopic))
        self.at = 0  # the index in `seqs` of the next seq to read
        self.count = min(query.count, budget.publications)
        self.budget = budget
        self.size = 0
        self.done = not self.seqs or self.count <= 0 or budget.bytes <= 0

    @property
    def answer(self) -> History:
        return History(self.rows, self.offset, self.epoch)

    def step(self, most: int) -> bool:
        """Read at most `most` more seqs; True once the answer is complete (then `answer` is it, and the
        budget was charged)."""
        if self.done:
            return True
        topic, seqs, rows, budget = self.topic, self.seqs, self.rows, self.budget
        if topic.epoch != self.epoch:  # the stream started again since the answer began: it ends here
            self.at = len(seqs)
        ring = topic if isinstance(topic, RingTopic) else None
        room, row_cost, first_always = budget.bytes, budget.row_cost, budget.first_always
        size, count = self.size, self.count
        at = self.at
        end = min(len(seqs), at + most)
        while at < end:
            seq = seqs[at]
            at += 1
            if ring is not None:
                entry = ring.stored(seq)
                if entry is None:
                    if seq < ring.begin:  # it left the ring since the answer began
                        at = len(seqs)
                        break
                    continue  # a seq given up in the ring: never published
            else:
                entry = _latest(topic, seq)
                if entry is None:
                    continue
            # the data runs from its key to the closing brace; the key's first occurrence is it (inside the
            # encoded topic every `"` is escaped): a third of core.entries.split_message's cost
            data = entry[entry.find(DATA_KEY, len(MSG_HEAD)) + len(DATA_KEY) : -1]
            cost = len(data) + row_cost
            if size + cost > room and (rows or not first_always):
                at = len(seqs)
                break
            size += cost
            rows.append((seq + 1, data))
            if len(rows) >= count:
                at = len(seqs)
                break
        self.at, self.size = at, size
        if at < len(seqs):
            return False
        self.done = True
        budget.publications -= len(rows)
        budget.bytes -= size
        return True


def _wanted(top: int, first: int, query: HistoryQuery, conflated: bool) -> range:
    """The seqs to answer from, in answer order (the holes given up in the ring are skipped later)."""
    since = query.since
    if query.reverse:
        upto = top if since is None else min(top, since[0] - 1)  # offsets < since.offset: seqs < offset - 1
        return range(upto - 1, first - 1, -1)
    if since is None:
        return range(first, top)
    start = since[0]  # offset o was seen: the next seq is o
    if start < first and not conflated:
        raise ApiError(
            UNRECOVERABLE_POSITION, f"publications after offset {start} have left the history (it starts at offset {first + 1})"
        )
    return range(max(start, first), top)


def _latest(topic: Topic, seq: int) -> bytes | None:
    assert isinstance(topic, SnapshotTopic)
    return topic.latest if seq == topic.seq else None


def json_publications(rows: list[Row]) -> bytes:
    """The rows as the JSON text of Centrifugo's `publications` array, in one join."""
    return b"[" + b",".join([b'{"data":%b,"offset":%d}' % (data, offset) for offset, data in rows]) + b"]"
