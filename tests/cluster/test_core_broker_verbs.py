"""The core verbs a broker feeds the engine with (docs/cluster.md §1): a topic started at a given epoch and
seq, `skip` of seqs the broker's stream dropped, `restart_topic` in a new epoch. Synchronous, no Redis.

Invariant: for each subscriber, the `msg` seqs and `loss` ranges it receives tile the seq line from its
`subscribed` seq without gap or overlap, whatever the broker does; an epoch change is announced."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import Engine, EngineConfig, TopicConfig

pytestmark = pytest.mark.unit


def drain(engine: Engine) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    while engine.has_work:
        for batch in engine.run_cycle():
            out.setdefault(batch.client_id, []).extend(orjson.loads(batch.frame()))  # type: ignore[arg-type]  # the test's client ids are strings
            engine.write_done(batch.client_id)
    return out


def tiles(entries: list[dict], start: int) -> int:
    """Check that msgs and losses tile [start, n) and return n."""
    at = start
    for entry in entries:
        if entry["type"] == "msg":
            assert entry["seq"] == at, (entry, at)
            at += 1
        elif entry["type"] == "loss":
            assert entry["from"] == at and entry["to"] > at, (entry, at)
            at = entry["to"]
    return at


steps = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(1, 5)),
        st.tuples(st.just("skip"), st.integers(1, 40)),
        st.tuples(st.just("read"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(start=st.integers(0, 2**40), capacity=st.integers(1, 16), steps=steps, late=st.booleans())
def test_a_topic_fed_by_a_broker_tiles_the_seq_line(start, capacity, steps, late):
    engine = Engine(EngineConfig())
    engine.create_topic("t", TopicConfig(capacity=capacity), epoch="E", start=start)
    engine.connect("early")
    assert engine.subscribe("early", "t").seq == start
    got: dict[str, list[dict]] = {}
    subscribed_at = {"early": start}
    end = start
    for op, n in steps:
        if op == "publish":
            for _ in range(n):
                engine.publish("t", end, seq=end)
                end += 1
        elif op == "skip":
            assert engine.skip("t", end + n)
            end += n
        for client, entries in drain(engine).items():
            got.setdefault(client, []).extend(entries)
        if late and "late" not in subscribed_at and op == "read":
            engine.connect("late")
            subscribed_at["late"] = engine.subscribe("late", "t", since=("E", start)).seq
    for client, entries in drain(engine).items():
        got.setdefault(client, []).extend(entries)
    for client, first in subscribed_at.items():
        entries = [e for e in got.get(client, []) if e["type"] in ("msg", "loss")]
        if client == "late":
            first = start  # since=start: a `gone` loss covers what the ring no longer holds
        assert tiles(entries, first) == end
    assert not engine.skip("t", end)  # nothing to skip below the end


def test_restart_tells_every_subscriber_the_epoch_changed_and_where_the_new_one_starts():
    engine = Engine(EngineConfig())
    engine.create_topic("t", TopicConfig(capacity=8), epoch="old", start=100)
    engine.connect("c")
    engine.subscribe("c", "t")
    engine.publish("t", "a", seq=100)
    drain(engine)
    engine.restart_topic("t", "new", 7)
    engine.publish("t", "b", seq=7)
    entries = drain(engine)["c"]
    assert entries == [
        {"type": "loss", "topic": "t", "from": 101, "to": None, "reason": "epoch"},
        {"type": "subscribed", "topic": "t", "kind": "ring", "epoch": "new", "seq": 7, "id": None},
        {"type": "msg", "topic": "t", "seq": 7, "data": "b"},
    ]
    assert engine.topic("t").epoch == "new"


def test_a_snapshot_starts_in_the_broker_epoch_and_a_seq_jump_is_not_a_loss():
    engine = Engine(EngineConfig())
    engine.create_topic("s", TopicConfig(kind="snapshot"), epoch="E", start=0)
    engine.publish("s", "v", seq=41)
    engine.connect("c")
    sub = engine.subscribe("c", "s")
    assert (sub.epoch, sub.seq) == ("E", 41)
    assert not engine.skip("s", 60)
    engine.publish("s", "w", seq=60)
    entries = [e for e in drain(engine)["c"] if e["type"] == "msg"]
    assert [e["seq"] for e in entries] == [41, 60]
