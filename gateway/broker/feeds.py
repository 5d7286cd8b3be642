"""A topic's feed from Redis into this node's engine: the SYNCING/LIVE machine of each served topic (`Line`),
without I/O (docs/cluster.md §3-4). topic_lines.py reads the streams and the channels and hands this machine
what came; the machine decides what goes into the engine, at which seq, and when the stream must be read.

* SYNCING: the topic's stream is being read (attach, a gap, Redis back); channel messages wait in the line's
  buffer (at most `BUFFER_MAX`; beyond, they are dropped and read again from the stream).
* LIVE: channel messages go into the engine as they come. A message past the local end (a lost channel
  message) or of another epoch makes the line SYNCING again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson

from core import RequestError, TopicConfig, TopicKind

from .base import BrokerEvents
from .keys import seq_of

log = logging.getLogger("gateway.broker")

#: Channel messages held per topic while it resyncs: the stream holds them anyway, so beyond this the
#: buffer is dropped and the stream read again, instead of growing with a hot topic's rate.
BUFFER_MAX = 10_000


class LineState(Enum):
    #: the stream is being read; channel messages wait in `buffer`
    SYNCING = "syncing"
    #: channel messages go into the engine as they come
    LIVE = "live"


class Step(Enum):
    """What a stream read (`Feed.settle`) leaves to do."""

    #: Redis holds another epoch: read its stream from the start and restart the local topic
    RESTART = "restart"
    #: a gap or an overflow remains: read the stream again from the local end
    AGAIN = "again"
    #: level with Redis: channel messages go in as they come
    LIVE = "live"


@dataclass(eq=False, slots=True)
class Line:
    """One topic this node serves: its feed from Redis into the engine."""

    name: str
    ready: asyncio.Future[None]
    state: LineState = LineState.SYNCING
    #: Redis's epoch of the local topic; None until the first sync created it
    epoch: str | None = None
    #: the next seq the engine expects (the local ring's end)
    next: int = 0
    kind: str = "ring"
    buffer: list[tuple[str, int, bytes]] = field(default_factory=list)
    overflow: bool = False
    task: asyncio.Task[None] | None = None
    release_timer: asyncio.TimerHandle | None = None
    #: the client whose subscribe made the attach (its creation budget pays if the topic is new in Redis),
    #: why it may not create it (None: it may), and whether the first TOUCH created it
    creator: Any = None
    refusal: tuple[str, str] | None = None
    created: bool = False


@dataclass(slots=True)
class Touched:
    """The TOUCH script's view of a topic (scripts.TOUCH): one consistent read of its meta and history."""

    created: bool
    epoch: str
    #: Redis's next seq
    top: int
    #: the settings written by the node that created it (JSON), and a snapshot's last value
    settings: bytes | None
    value: bytes | None
    #: stream entries from the id asked on: [(id, fields), ...]
    entries: list[Any]

    @classmethod
    def of(cls, reply: list[Any]) -> "Touched":
        created, epoch, top, settings, value, entries = reply
        return cls(created == 1, epoch.decode(), int(top), settings, value, entries)


class Feed:
    """The machine of every line, feeding the engine through the broker's events (no I/O: the caller reads
    Redis and starts a stream read when a method says so)."""

    def __init__(self, events: BrokerEvents) -> None:
        self.events = events

    def receive(self, line: Line, epoch: str, seq: int, data: bytes) -> bool:
        """A channel message. True: the line just became SYNCING, so its stream must be read."""
        if line.state is LineState.LIVE and self.apply(line, epoch, seq, data):
            return False
        if len(line.buffer) < BUFFER_MAX:
            line.buffer.append((epoch, seq, data))
        else:
            line.overflow = True
        if line.state is LineState.LIVE:
            line.state = LineState.SYNCING
            return True
        return False

    def apply(self, line: Line, epoch: str, seq: int, data: bytes) -> bool:
        """Put one channel message into the engine. False: it needs a resync first (a gap, another epoch)."""
        if epoch != line.epoch:
            return False
        if seq < line.next:
            return True  # the stream read already gave it
        if seq > line.next and line.kind != TopicKind.SNAPSHOT.value:  # a snapshot's jump is conflation
            return False
        self.feed(line, seq, data)
        line.next = seq + 1
        self.events.wake()
        return True

    def feed(self, line: Line, seq: int, data: bytes) -> None:
        try:
            # the publishing node encoded `data` (orjson) for the stream: embed it, never decode and re-encode
            self.events.apply(line.name, orjson.Fragment(data), seq=seq)
        except RequestError as exc:
            # e.g. larger than this node's scheduler.max_message_bytes: its subscribers are told it is lost.
            log.warning("broker: seq %d of %r cannot be stored here: %s", seq, line.name, exc)
            self.events.skip(line.name, seq + 1)

    def settle(self, line: Line, touched: Touched, config: TopicConfig, fresh: bool, restart: bool) -> Step:
        """Bring the local topic level with what a stream read found (`fresh`: the engine has no such topic
        yet; `restart`: the read was from the start of another epoch), then apply what waited in the buffer."""
        line.created = line.created or touched.created
        line.kind = config.kind.value
        if not fresh and touched.epoch != line.epoch and not restart:
            return Step.RESTART
        line.overflow = False
        if config.kind is TopicKind.SNAPSHOT:
            self._snapshot(line, fresh, restart, touched, config)
        else:
            self._ring(line, fresh, restart, touched, config)
        line.epoch = touched.epoch
        self.events.wake()
        buffer, line.buffer = line.buffer, []
        line.state = LineState.LIVE
        for i, (epoch, seq, data) in enumerate(buffer):
            if not self.apply(line, epoch, seq, data):
                line.buffer = buffer[i:] + line.buffer
                line.state = LineState.SYNCING
                break
        return Step.LIVE if line.state is LineState.LIVE and not line.overflow else Step.AGAIN

    def _ring(self, line: Line, fresh: bool, restart: bool, touched: Touched, config: TopicConfig) -> None:
        events = self.events
        entries = touched.entries
        start = seq_of(entries[0][0]) if entries else touched.top
        if fresh:
            events.create_topic(line.name, config, epoch=touched.epoch, start=start)
            line.next = start
        elif restart:
            events.restart_topic(line.name, touched.epoch, start)
            line.next = start
        elif start > line.next:
            # Published while this node did not listen, and trimmed from the stream since: exactly lost.
            self.events.skip(line.name, start)
            line.next = start
        for entry_id, fields in entries:
            seq = seq_of(entry_id)
            if seq >= line.next:
                self.feed(line, seq, _field(fields, b"d"))
                line.next = seq + 1

    def _snapshot(self, line: Line, fresh: bool, restart: bool, touched: Touched, config: TopicConfig) -> None:
        events = self.events
        if fresh:
            events.create_topic(line.name, config, epoch=touched.epoch, start=0)
            line.next = 0
        elif restart:
            events.restart_topic(line.name, touched.epoch, 0)
            line.next = 0
        if touched.value is not None and touched.top - 1 >= line.next:
            self.feed(line, touched.top - 1, touched.value)
        line.next = max(line.next, touched.top)


def _field(fields: list[bytes], name: bytes) -> bytes:
    """A stream entry's field (redis-py gives a flat list or a dict, depending on the parser)."""
    if isinstance(fields, dict):
        return fields[name]
    for i in range(0, len(fields), 2):
        if fields[i] == name:
            return fields[i + 1]
    raise KeyError(name)
