"""Crowds (`Engine.crowding`, `Engine.take_crowds`): clients with an open sink whose batch would be one
entry, caught up, are gathered by entry and variant instead of getting a batch each. What each client
receives must be exactly what it would receive as batches: a twin engine without crowding is the oracle."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from core import Crowd, Engine, EngineConfig, Sink, TopicConfig, TopicKind, TopicRule
from core.client import ClientState

pytestmark = pytest.mark.unit

CLIENTS = ["c0", "c1", "c2", "c3"]
TOPICS = ["r0", "r1", "s0", "p0"]


def make_engine() -> Engine:
    rules = (
        TopicRule("r*", TopicConfig(capacity=4)),
        TopicRule("s*", TopicConfig(kind=TopicKind.SNAPSHOT)),
        TopicRule("p*", TopicConfig(kind=TopicKind.PRIVATE, max_count=3)),
    )
    return Engine(EngineConfig(rules=rules, cycle_budget_bytes=300), instance_id="h")


def connect(engine: Engine, client_id: str, *, variant: int = 0, token: int = 3) -> Sink:
    engine.connect(client_id)
    sink = Sink(token, variant, f"handle-{client_id}", client_id)
    engine.attach_sink(client_id, sink)
    return sink


def test_caught_up_clients_with_open_sinks_are_gathered_by_entry_and_variant() -> None:
    engine = make_engine()
    engine.crowding = True
    sinks = {c: connect(engine, c, variant=1 if c == "c3" else 0, token=10 + i) for i, c in enumerate(CLIENTS)}
    for c in CLIENTS:
        engine.subscribe(c, "r0")
    # the subscribed notices: a client's own entries, in batches
    assert len(engine.run_cycle()) == len(CLIENTS) and engine.take_crowds() == []
    engine.writes_done(CLIENTS)
    engine.publish("r0", {"n": 1})
    assert engine.run_cycle() == []
    crowds = engine.take_crowds()
    assert [(c.variant, c.tokens) for c in crowds] == [(0, [10, 11, 12]), (1, [13])]
    assert crowds[0].entry is crowds[1].entry  # stored and encoded once: the same object for all
    assert orjson.loads(crowds[0].entry)["data"] == {"n": 1}
    assert crowds[0].handles == ["handle-c0", "handle-c1", "handle-c2"]
    assert [s.owner for s in crowds[0].sinks] == ["c0", "c1", "c2"]
    # counted written, and left ready: nothing for the gateway to report but a blocked socket
    assert all(engine.client(c).state is ClientState.READY for c in CLIENTS)
    # counted in the sinks, with the frame's bytes (a batch is counted by whoever writes it)
    assert all(s.frames == 1 and s.entries == 1 for s in sinks.values())
    assert sinks["c0"].bytes == len(b"[" + crowds[0].entry + b"]")
    assert engine.take_crowds() == []  # taken once


def test_a_closed_sink_a_backlog_or_a_batch_of_two_gets_a_batch() -> None:
    engine = make_engine()
    engine.crowding = True
    sinks = {c: connect(engine, c) for c in CLIENTS}
    for c in CLIENTS:
        engine.subscribe(c, "r0")
    engine.subscribe("c2", "r1")
    engine.writes_done(b.client_id for b in engine.run_cycle())
    sinks["c1"].open = False
    engine.publish("r0", {"n": 1})
    engine.publish("r1", {"n": 2})  # c2 gets two entries
    batches = {str(b.client_id): b for b in engine.run_cycle()}
    crowds = engine.take_crowds()
    assert sorted(batches) == ["c1", "c2"]
    assert len(batches["c2"].entries) == 2
    assert [[s.owner for s in c.sinks] for c in crowds] == [["c0", "c3"]]
    assert engine.client("c1").state is ClientState.WRITING
    assert sinks["c1"].frames == 0  # a batch is counted by whoever writes it


def test_crowding_off_gives_batches_as_before() -> None:
    engine = make_engine()
    for c in CLIENTS:
        connect(engine, c)
        engine.subscribe(c, "r0")
    engine.writes_done(b.client_id for b in engine.run_cycle())
    engine.publish("r0", {"n": 1})
    assert len(engine.run_cycle()) == len(CLIENTS)
    assert engine.take_crowds() == []


class TwinMachine(RuleBasedStateMachine):
    """The same operations on two engines, one gathering crowds: every client receives the same entries."""

    def __init__(self) -> None:
        super().__init__()
        self.crowding, self.plain = make_engine(), make_engine()
        self.crowding.crowding = True
        self.sinks: dict[str, tuple[Sink, Sink]] = {}
        self.received: dict[str, tuple[list[bytes], list[bytes]]] = {}
        #: clients whose last write has not completed: a batch still WRITING, or a crowd's socket that did
        #: not take its frame (the gateway marks it idle until it drains)
        self.writing: set[str] = set()
        self.seq = 0

    def both(self, method: str, *args: object, **kwargs: object) -> None:
        outcomes: list[type[Exception] | None] = []
        for engine in (self.crowding, self.plain):
            try:
                getattr(engine, method)(*args, **kwargs)
                outcomes.append(None)
            except Exception as exc:  # the same refusal from both
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1]

    @rule(c=st.sampled_from(CLIENTS), variant=st.sampled_from([0, 1]))
    def connect(self, c: str, variant: int) -> None:
        if c in self.sinks:
            return
        self.sinks[c] = (connect(self.crowding, c, variant=variant), connect(self.plain, c, variant=variant))
        self.received[c] = ([], [])

    @rule(c=st.sampled_from(CLIENTS), topic=st.sampled_from(TOPICS))
    def subscribe(self, c: str, topic: str) -> None:
        if c in self.sinks and topic not in self.crowding.client(c).subs:
            self.both("subscribe", c, topic)

    @rule(c=st.sampled_from(CLIENTS), topic=st.sampled_from(TOPICS))
    def unsubscribe(self, c: str, topic: str) -> None:
        if c in self.sinks and topic in self.crowding.client(c).subs:
            self.both("unsubscribe", c, topic)

    @rule(topic=st.sampled_from(TOPICS), c=st.sampled_from(CLIENTS), size=st.integers(0, 120))
    def publish(self, topic: str, c: str, size: int) -> None:
        self.seq += 1
        self.both("publish", topic, {"n": self.seq, "pad": "x" * size}, owner=c)

    @rule(c=st.sampled_from(CLIENTS), open_=st.booleans())
    def sink_open(self, c: str, open_: bool) -> None:
        if c in self.sinks:
            for sink in self.sinks[c]:
                sink.open = open_

    @rule(c=st.sampled_from(CLIENTS))
    def reply(self, c: str) -> None:
        if c in self.sinks:
            self.both("send_direct", c, b'{"type":"reply"}')

    @rule(c=st.sampled_from(CLIENTS))
    def disconnect(self, c: str) -> None:
        if c in self.sinks:
            self.both("disconnect", c)
            del self.sinks[c]
            self.writing.discard(c)

    @rule(complete=st.booleans())
    def cycle(self, complete: bool) -> None:
        for side, engine in enumerate((self.crowding, self.plain)):
            for batch in engine.run_cycle():
                client_id = str(batch.client_id)
                self.received[client_id][side].extend(batch.entries)
                if complete:
                    engine.write_done(client_id)
                else:
                    self.writing.add(client_id)
            for crowd in engine.take_crowds():
                assert isinstance(crowd, Crowd)
                for sink in crowd.sinks:
                    assert sink.open and sink.variant == crowd.variant
                    self.received[sink.owner][side].append(crowd.entry)
                    if not complete:
                        engine.mark_idle(sink.owner)
                        self.writing.add(sink.owner)

    @rule()
    def writes_done(self) -> None:
        for c in sorted(self.writing):
            for engine in (self.crowding, self.plain):
                state = engine.client(c).state
                if state is ClientState.WRITING:
                    engine.write_done(c)
                elif state is ClientState.IDLE:
                    engine.mark_ready(c)
        self.writing.clear()

    @invariant()
    def same_entries(self) -> None:
        for c, (crowded, batched) in self.received.items():
            assert crowded == batched, c

    @invariant()
    def same_counts(self) -> None:
        assert self.crowding.counters.entries_emitted == self.plain.counters.entries_emitted
        assert self.crowding.counters.clients_served == self.plain.counters.clients_served


TestTwins = TwinMachine.TestCase
TestTwins.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
