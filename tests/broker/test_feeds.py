"""The SYNCING/LIVE machine of a topic fed from Redis (gateway/broker/feeds.py), without Redis: what it hands a
real core engine, seen as the entries a subscriber of that engine gets."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import orjson
import pytest

from core import Engine, EngineConfig, Published, TopicConfig, TopicKind
from gateway.broker.feeds import BUFFER_MAX, Feed, Line, LineState, Step, Touched

pytestmark = pytest.mark.unit

RING = TopicConfig(kind=TopicKind.RING, capacity=100)


class EngineEvents:
    """The broker events the machine uses, straight onto a real engine (the scheduler does the same and wakes)."""

    def __init__(self) -> None:
        self.engine = Engine(EngineConfig(), instance_id="node")
        self.topics = self.engine
        self.wakes = 0

    def create_topic(
        self, name: str, config: TopicConfig | None = None, *, epoch: str | None = None, start: int = 0
    ) -> dict[str, Any]:
        return self.engine.create_topic(name, config, epoch=epoch, start=start).info()

    def restart_topic(self, name: str, epoch: str, start: int) -> None:
        self.engine.restart_topic(name, epoch, start)

    def apply(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published:
        return self.engine.publish(topic, data, seq=seq, owner=owner)

    def skip(self, topic: str, upto: int) -> None:
        self.engine.skip(topic, upto)

    def wake(self) -> None:
        self.wakes += 1


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(loop) -> tuple[Feed, EngineEvents, Line]:
    events = EngineEvents()
    return Feed(events), events, Line("t", loop.create_future())  # type: ignore[arg-type]


def touched(epoch: str, entries: list[tuple[int, Any]], top: int | None = None) -> Touched:
    stream = [(f"{seq}-1".encode(), [b"d", orjson.dumps(data)]) for seq, data in entries]
    return Touched(False, epoch, top if top is not None else (entries[-1][0] + 1 if entries else 0), None, None, stream)


def payload(data: Any) -> bytes:
    return orjson.dumps(data)


def watch(events: EngineEvents, since: tuple[str, int] | None = None) -> None:
    events.engine.connect("c")
    events.engine.subscribe("c", "t", since=since)


def got(events: EngineEvents) -> list[dict[str, Any]]:
    """What the subscriber `c` is handed now (its `subscribed` included)."""
    out: list[dict[str, Any]] = []
    for _ in range(1000):  # a cycle hands each client its batch depth: run them until none is left
        batches = events.engine.run_cycle()
        if not batches:
            return out
        for batch in batches:
            out += [orjson.loads(entry) for entry in batch.entries]
            events.engine.write_done(batch.client_id)
    raise AssertionError("the engine never ran out of work")


def msgs(entries: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    return [(e["seq"], e["data"]) for e in entries if e["type"] == "msg"]


def test_a_fresh_line_creates_the_topic_at_the_streams_first_seq_and_goes_live(loop):
    feed, events, line = make(loop)
    step = feed.settle(line, touched("E1", [(5, "a"), (6, "b")]), RING, fresh=True, restart=False)
    assert step is Step.LIVE and line.state is LineState.LIVE and (line.epoch, line.next) == ("E1", 7)
    watch(events, since=("E1", 5))
    assert msgs(got(events)) == [(5, "a"), (6, "b")]


def test_live_messages_go_in_at_once_and_one_past_the_end_makes_the_line_sync(loop):
    feed, events, line = make(loop)
    feed.settle(line, touched("E1", [(0, "a")]), RING, fresh=True, restart=False)
    watch(events, since=("E1", 0))
    got(events)
    assert feed.receive(line, "E1", 1, payload("b")) is False
    assert feed.receive(line, "E1", 1, payload("b again")) is False  # already delivered: dropped
    assert msgs(got(events)) == [(1, "b")]
    assert feed.receive(line, "E1", 3, payload("d")) is True  # seq 2 never came: read the stream
    assert line.state is LineState.SYNCING and line.buffer == [("E1", 3, payload("d"))]
    assert feed.receive(line, "E1", 4, payload("e")) is False  # already syncing: buffered only
    assert got(events) == []


def test_a_sync_fills_the_gap_from_the_stream_then_applies_the_buffer_once(loop):
    feed, events, line = make(loop)
    feed.settle(line, touched("E1", [(0, "a")]), RING, fresh=True, restart=False)
    watch(events, since=("E1", 0))
    for seq in (2, 3, 4):
        feed.receive(line, "E1", seq, payload(f"m{seq}"))
    # the stream read (from seq 1) saw up to 3; 4 came on the channel only
    step = feed.settle(line, touched("E1", [(1, "m1"), (2, "m2"), (3, "m3")]), RING, fresh=False, restart=False)
    assert step is Step.LIVE and line.buffer == [] and line.next == 5
    assert msgs(got(events)) == [(0, "a"), (1, "m1"), (2, "m2"), (3, "m3"), (4, "m4")]


def test_a_gap_the_stream_no_longer_holds_is_an_exact_loss_notice(loop):
    feed, events, line = make(loop)
    feed.settle(line, touched("E1", [(0, "a")]), RING, fresh=True, restart=False)
    watch(events, since=("E1", 0))
    got(events)
    feed.receive(line, "E1", 9, payload("late"))
    feed.settle(line, touched("E1", [(7, "x"), (8, "y")]), RING, fresh=False, restart=False)  # 1..6 trimmed
    entries = got(events)
    assert [e for e in entries if e["type"] == "loss"] == [
        {"type": "loss", "topic": "t", "from": 1, "to": 7, "reason": "skipped"}
    ]
    assert msgs(entries) == [(7, "x"), (8, "y"), (9, "late")]


def test_another_epoch_in_redis_restarts_the_topic_with_the_epoch_notice(loop):
    feed, events, line = make(loop)
    feed.settle(line, touched("E1", [(0, "a"), (1, "b")]), RING, fresh=True, restart=False)
    watch(events, since=("E1", 0))
    got(events)
    feed.receive(line, "E2", 6, payload("new"))  # a message of an epoch this node does not know
    assert line.state is LineState.SYNCING
    assert feed.settle(line, touched("E2", [(6, "new")]), RING, fresh=False, restart=False) is Step.RESTART
    assert line.epoch == "E1" and got(events) == []  # nothing changed before the read from the start
    assert feed.settle(line, touched("E2", [(6, "new")]), RING, fresh=False, restart=True) is Step.LIVE
    entries = got(events)
    assert entries[0] == {"type": "loss", "topic": "t", "from": 2, "to": None, "reason": "epoch"}
    assert entries[1]["type"] == "subscribed" and (entries[1]["epoch"], entries[1]["seq"]) == ("E2", 6)
    assert msgs(entries) == [(6, "new")]


def test_an_overflowing_buffer_is_dropped_and_read_again_from_the_stream(loop):
    feed, events, line = make(loop)
    feed.settle(line, touched("E1", []), RING, fresh=True, restart=False)
    line.state = LineState.SYNCING  # e.g. Redis lost: everything comes again from the stream
    for seq in range(BUFFER_MAX + 5):
        feed.receive(line, "E1", seq, payload(seq))
    assert len(line.buffer) == BUFFER_MAX and line.overflow
    # the read happened while more came: the buffer's head is in the stream, the tail past it
    step = feed.settle(line, touched("E1", [(s, s) for s in range(3)]), RING, fresh=False, restart=False)
    assert step is Step.LIVE and line.next == BUFFER_MAX  # the buffer's tail went in after the stream's part
    more = feed.receive(line, "E1", BUFFER_MAX + 4, payload("x"))  # the overflowed ones are missing: read again
    assert more is True and line.state is LineState.SYNCING


def test_a_snapshot_jump_is_conflation_not_a_gap(loop):
    feed, events, line = make(loop)
    snapshot = TopicConfig(kind=TopicKind.SNAPSHOT)
    value = Touched(False, "E1", 4, None, orjson.dumps("v3"), [])
    assert feed.settle(line, value, snapshot, fresh=True, restart=False) is Step.LIVE
    assert line.next == 4
    assert feed.receive(line, "E1", 9, payload("v9")) is False  # later values only: no sync
    assert line.state is LineState.LIVE and line.next == 10
