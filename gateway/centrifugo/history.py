"""History as Centrifugo's server API answers it, read from a topic this node holds (docs/centrifugo.md).

A publication's offset is its seq + 1, so the stream position (`offset`) is the offset of the newest
publication, 0 before the first. `limit` 0 asks for the position only, -1 for everything retained, N for N
publications: the oldest N, or with `reverse` the newest N, newest first. `since` {offset, epoch} asks for
the publications after it (with `reverse`: before it). Stricter than Centrifugo, which answers what is left:
when some publication after `since` has left the ring the answer is error 112 (unrecoverable position),
never a list with a hole the caller could not see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from core.ring import RingTopic
from core.snapshot import SnapshotTopic
from core.topics import Topic

from .api_errors import NOT_AVAILABLE, UNRECOVERABLE_POSITION, ApiError, bad_request

#: publications one answer holds at most, whatever `limit` asks (a caller pages on with `since`)
MAX_PUBLICATIONS = 10_000
#: and at most this many bytes of stored messages (the first always goes): an answer of ring capacity x 1 MiB
#: messages is never built in one turn of the event loop
MAX_BYTES = 8 << 20


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


def position_only(offset: int, epoch: str) -> dict[str, Any]:
    return {"publications": [], "offset": offset, "epoch": epoch}


def read(topic: Topic, query: HistoryQuery) -> dict[str, Any]:
    """The history answer of a ring or snapshot topic (`{"publications", "offset", "epoch"}`)."""
    if isinstance(topic, RingTopic):
        top, first = topic.end, topic.begin
    elif isinstance(topic, SnapshotTopic):
        top, first = topic.seq + 1, topic.seq  # one publication retained: the latest
    else:
        raise ApiError(NOT_AVAILABLE, f"topic {topic.name[:256]!r} is a private queue: no history")
    since = query.since
    if since is not None and since[1] and since[1] != topic.epoch:
        raise ApiError(UNRECOVERABLE_POSITION, f"since.epoch {since[1][:64]!r} is not the topic's {topic.epoch!r}")
    if query.limit == 0:
        return position_only(top, topic.epoch)
    seqs = _wanted(top, max(first, 0), query, isinstance(topic, SnapshotTopic))
    return {"publications": _publications(topic, seqs, query.count), "offset": top, "epoch": topic.epoch}


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
        raise ApiError(UNRECOVERABLE_POSITION, f"publications after offset {start} have left the history "
                                               f"(it starts at offset {first + 1})")
    return range(max(start, first), top)


def _publications(topic: Topic, seqs: range, count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    size = 0
    for seq in seqs:
        if len(out) >= count or (out and size >= MAX_BYTES):
            break
        entry = _entry(topic, seq)
        if entry is None:  # a seq given up in the ring: never published
            continue
        size += len(entry)
        out.append({"data": orjson.loads(entry)["data"], "offset": seq + 1})
    return out


def _entry(topic: Topic, seq: int) -> bytes | None:
    if isinstance(topic, RingTopic):
        return topic.stored(seq)
    assert isinstance(topic, SnapshotTopic)
    return topic.latest if seq == topic.seq else None
