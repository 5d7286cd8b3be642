"""`batch_depth = "auto"` on ring topics (docs/design/batching.md §8): the slice follows the backlog, the
scheduler's promises stay. Hypothesis state machine plus a few worked examples; semantics only, no speed."""

from __future__ import annotations

import math
from typing import cast

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from core import Engine, EngineConfig, TopicConfig, TopicKind, TopicRule, encode_reply
from core.config import AUTO_DEPTH, AUTO_MAX_SLICE, AUTO_MAX_SPAN
from core.ring import RingTopic
from tests.core.core_helpers import cycle, messages

pytestmark = pytest.mark.unit

BUDGET = 2000
#: auto rings of three sizes: a small ring (a slice takes the whole backlog), one between the bound and the
#: span cap (proportional), one past the cap (a quarter of the backlog); a depth-1 ring beside them
TOPICS = {"a8": 8, "a100": 100, "a512": 512, "d8": 8}
AUTO_TOPICS = {"a8", "a100", "a512"}
CLIENTS = ["c0", "c1"]
DIRECT_TYPES = {"subscribed", "unsubscribed", "reply"}
#: a loss notice is at most this long (topic names here are short)
NOTICE_MAX = 100


def auto_slice(lag: int, capacity: int) -> int:
    """What the design says an auto handle `lag` behind may take in one cycle."""
    return min(AUTO_MAX_SLICE, math.ceil(lag * AUTO_MAX_SLICE / min(capacity, AUTO_MAX_SPAN)))


def auto_engine(budget: int = BUDGET) -> Engine:
    rules = tuple(
        TopicRule(name, TopicConfig(capacity=cap, batch_depth="auto" if name in AUTO_TOPICS else 1))
        for name, cap in TOPICS.items()
    )
    return Engine(EngineConfig(rules=rules, cycle_budget_bytes=budget), instance_id="h")


class AutoDepthMachine(RuleBasedStateMachine):
    """Clients on auto rings and a depth-1 ring, publishes of small and large messages, replies, writes that
    stay pending (so subscribers fall behind, and off the ring). Each batch is checked against a model of
    every cursor and against the slice and share rules."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = auto_engine()
        self.connected: dict[str, set[str]] = {}
        self.writing: set[str] = set()
        #: next seq each (client, topic) is owed: every seq is delivered or announced lost, in order
        self.expect: dict[tuple[str, str], int] = {}
        #: served batches in a row in which the handle had data and got no entry
        self.missed: dict[tuple[str, str], int] = {}
        self.counter = 0

    # -- clients -----------------------------------------------------------------------------------------

    @initialize(subs=st.lists(st.sets(st.sampled_from(sorted(TOPICS)), min_size=1), min_size=2, max_size=2))
    def start(self, subs: list[set[str]]) -> None:
        """Both clients connected, each on some topics: most steps then move data."""
        for c, topics in zip(CLIENTS, subs):
            self.connect(c)
            for t in sorted(topics):
                self.subscribe(c, t)

    @rule(c=st.sampled_from(CLIENTS))
    def connect(self, c: str) -> None:
        if c not in self.connected:
            self.engine.connect(c)
            self.connected[c] = set()

    @rule(c=st.sampled_from(CLIENTS))
    def disconnect(self, c: str) -> None:
        if c in self.connected:
            self.engine.disconnect(c)
            for t in self.connected.pop(c):
                self.expect.pop((c, t))
                self.missed.pop((c, t), None)
            self.writing.discard(c)

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(sorted(TOPICS)))
    def subscribe(self, c: str, t: str) -> None:
        if c not in self.connected or t in self.connected[c]:
            return
        result = self.engine.subscribe(c, t)
        self.connected[c].add(t)
        self.expect[(c, t)] = result.seq

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(sorted(TOPICS)))
    def unsubscribe(self, c: str, t: str) -> None:
        if c not in self.connected or t not in self.connected[c]:
            return
        self.engine.unsubscribe(c, t)
        self.connected[c].discard(t)
        del self.expect[(c, t)]
        self.missed.pop((c, t), None)

    @rule(c=st.sampled_from(CLIENTS), n=st.integers(1, 3))
    def reply(self, c: str, n: int) -> None:
        if c in self.connected:
            for _ in range(n):
                self.counter += 1
                self.engine.send_direct(c, encode_reply(self.counter, "ok"))

    # -- producers ---------------------------------------------------------------------------------------

    @rule(t=st.sampled_from(sorted(TOPICS)), n=st.integers(1, 150), pad=st.sampled_from([0, 20, 300]))
    def publish(self, t: str, n: int, pad: int) -> None:
        for _ in range(n):
            self.engine.publish(t, "x" * pad)

    # -- the scheduler -------------------------------------------------------------------------------------

    @rule(c=st.sampled_from(CLIENTS))
    def finish_write(self, c: str) -> None:
        if c in self.writing:
            self.writing.discard(c)
            self.engine.write_done(c)

    @rule(complete=st.booleans())
    def run_cycle(self, complete: bool) -> None:
        before = {c: self._state_of(c) for c in self.connected if c not in self.writing}
        for batch in self.engine.run_cycle():
            c = cast(str, batch.client_id)
            self._check_batch(c, batch, before[c])
            if complete:
                self.engine.write_done(c)
            else:
                self.writing.add(c)

    @rule()
    def drain(self) -> None:
        """Every write completes and cycles run until nothing is left: each cursor is then at the end."""
        for c in list(self.writing):
            self.engine.write_done(c)
        self.writing.clear()
        for _ in range(1000):
            before = {c: self._state_of(c) for c in self.connected}
            batches = self.engine.run_cycle()
            if not batches:
                break
            for batch in batches:
                self._check_batch(cast(str, batch.client_id), batch, before[cast(str, batch.client_id)])
                self.engine.write_done(batch.client_id)
        for (c, t), seq in self.expect.items():
            assert seq == cast(RingTopic, self.engine.topic(t)).end, (c, t)

    @invariant()
    def nothing_owed_is_skipped(self) -> None:
        for (_c, t), seq in self.expect.items():
            assert seq <= cast(RingTopic, self.engine.topic(t)).end

    # -- checks ------------------------------------------------------------------------------------------

    def _state_of(self, c: str) -> dict:
        """What the client holds before a cycle: its active handles in order, and per topic the backlog."""
        client = self.engine.client(c)
        state: dict = {"order": [sub.topic.name for sub in client.active], "direct": len(client.direct or ()), "topics": {}}
        for t in self.connected[c]:
            ring = cast(RingTopic, self.engine.topic(t))
            cursor = self.expect[(c, t)]
            first = max(cursor, ring.begin)
            window = range(first, min(ring.end, first + AUTO_MAX_SLICE + 1))
            state["topics"][t] = {
                "lag": ring.end - cursor,
                "available": ring.end - first,
                "sizes": [len(cast(bytes, ring.slots[s % ring.capacity])) for s in window],
            }
        return state

    def _check_batch(self, c: str, batch, state: dict) -> None:
        raw = batch.entries
        entries = [orjson.loads(e) for e in raw]
        # Never far above the budget: every entry was added while the batch was under it (at most one
        # entry past it).
        assert sum(len(e) for e in raw[:-1]) < BUDGET
        # Replies first: the direct entries lead, and as many as the budget let through.
        n_direct = 0
        while n_direct < len(entries) and entries[n_direct]["type"] in DIRECT_TYPES:
            n_direct += 1
        assert all(e["type"] in ("msg", "loss") for e in entries[n_direct:])
        direct_bytes = sum(len(e) for e in raw[:n_direct])
        assert n_direct == state["direct"] or direct_bytes >= BUDGET
        # Topic entries come as one run per handle, in the handle order.
        segments: list[tuple[str, list[int]]] = []
        for i in range(n_direct, len(entries)):
            t = entries[i]["topic"]
            if not segments or segments[-1][0] != t:
                assert t not in [s[0] for s in segments], f"{t} twice in one batch"
                segments.append((t, []))
            segments[-1][1].append(i)
        order = state["order"]
        served = [t for t, _ in segments]
        assert served == [t for t in order if t in served]  # only active handles, in their order
        room = BUDGET - direct_bytes
        for t, idx in segments:
            self._check_segment(
                c,
                t,
                [entries[i] for i in idx],
                sum(len(raw[i]) for i in idx),
                state["topics"][t],
                room,
                len(order) - order.index(t),
            )
            room -= sum(len(raw[i]) for i in idx)
        # Starvation. While every entry (and a loss notice) fits in an equal share of what the replies left
        # of the budget, every handle with data gets an entry: an auto slice stays within its share. And
        # in batches whose replies leave three quarters of the budget, no handle misses two in a row.
        largest = max((max(state["topics"][t]["sizes"], default=0) for t in order), default=0)
        fits = bool(order) and largest + NOTICE_MAX <= (BUDGET - direct_bytes) / len(order)
        for t in order:
            if t in served:
                self.missed[(c, t)] = 0
                continue
            assert not fits, f"{t} got nothing although every entry fitted in a share"
            if direct_bytes <= BUDGET // 4:
                self.missed[(c, t)] = self.missed.get((c, t), 0) + 1
                assert self.missed[(c, t)] <= 1, f"{t} starved for two cycles"

    def _check_segment(self, c: str, t: str, got: list[dict], size: int, topic: dict, room: int, left: int) -> None:
        # Every seq delivered or announced lost, exact ranges, in order.
        seq = self.expect[(c, t)]
        msgs = 0
        for e in got:
            if e["type"] == "loss":
                assert e["from"] == seq and e["to"] > seq and e["reason"] == "lagged"
                seq = e["to"]
            else:
                assert e["seq"] == seq
                seq += 1
                msgs += 1
        self.expect[(c, t)] = seq
        if t not in AUTO_TOPICS:
            assert msgs <= 1
            return
        lag = topic["lag"]
        want = min(auto_slice(lag, TOPICS[t]), topic["available"])
        share = -(-room // left)
        assert msgs <= want <= AUTO_MAX_SLICE
        if lag == 1:
            assert msgs == 1, "a caught-up auto subscriber gets one message per cycle"
        if msgs > 1:
            assert size <= share, "entries past the first stay within the handle's share of the budget"
        if msgs < want:  # stopped early: the next message did not fit in the share
            assert size + topic["sizes"][msgs] > share


TestAutoDepthMachine = AutoDepthMachine.TestCase
TestAutoDepthMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- worked examples -----------------------------------------------------------------------------------------


def subscribed(engine: Engine, client: str, *topics: str) -> None:
    engine.connect(client)
    for t in topics:
        engine.subscribe(client, t)
    cycle(engine)  # the `subscribed` entries


def test_a_caught_up_subscriber_gets_one_message_per_cycle():
    engine = auto_engine(budget=1 << 16)
    subscribed(engine, "a", "a100")
    for n in range(20):
        engine.publish("a100", n)
        assert [messages(e) for e in cycle(engine).values()] == [[n]]


@settings(max_examples=60, deadline=None)
@given(capacity=st.sampled_from([1, 8, 64, 100, 256, 512, 4096]), lag=st.integers(1, 600))
def test_a_lagging_subscriber_gets_a_slice_sized_by_its_backlog(capacity, lag):
    engine = Engine(
        EngineConfig(rules=(TopicRule("*", TopicConfig(capacity=capacity, batch_depth="auto")),), cycle_budget_bytes=1 << 20),
        instance_id="h",
    )
    subscribed(engine, "a", "t")
    for n in range(lag):
        engine.publish("t", n)
    got = cycle(engine)["a"]
    begin = max(0, lag - capacity)  # the oldest message the ring still holds
    want = min(auto_slice(lag, capacity), lag - begin)
    assert messages(got) == list(range(begin, begin + want))
    assert 1 <= want <= AUTO_MAX_SLICE
    assert [e for e in got if e["type"] == "loss"] == (
        [{"type": "loss", "topic": "t", "from": 0, "to": begin, "reason": "lagged"}] if begin else []
    )
    if lag > 1 and capacity > 1 and lag * AUTO_MAX_SLICE > min(capacity, AUTO_MAX_SPAN):
        assert want > 1  # behind by more than span / bound: more than depth 1 would give


def test_a_burst_is_caught_up_in_fewer_cycles_than_at_depth_1_and_nothing_is_lost():
    engine = auto_engine(budget=1 << 16)
    subscribed(engine, "a", "a512", "d8")
    for n in range(400):
        engine.publish("a512", n)
    got: list[int] = []
    cycles = 0
    while batch := cycle(engine):
        cycles += 1
        assert not [e for e in batch["a"] if e["type"] == "loss"]
        got += messages(batch["a"], "a512")
    assert got == list(range(400))
    assert cycles < 30  # a quarter of the backlog per cycle, at most 64: 64 x 4, then a geometric tail


def test_two_auto_topics_with_large_messages_leave_a_depth_1_topic_its_turn_every_cycle():
    # Without the share rule the first auto handle fills the budget, the second goes first the next cycle
    # and fills it again: the depth-1 topic would wait two cycles.
    engine = auto_engine(budget=3000)
    subscribed(engine, "a", "a8", "a100", "d8")
    for _ in range(60):
        engine.publish("a8", "x" * 300)
        engine.publish("a100", "x" * 300)
    for n in range(5):
        engine.publish("d8", n)
    for n in range(4):  # a8 keeps 8 messages, 2 fit in its share per cycle
        batch = cycle(engine)["a"]
        assert messages(batch, "d8") == [n]
        assert len(messages(batch, "a8")) >= 1 and len(messages(batch, "a100")) >= 1


def test_replies_go_before_an_auto_slice():
    engine = auto_engine(budget=1 << 16)
    subscribed(engine, "a", "a8")
    for n in range(8):
        engine.publish("a8", n)
    engine.send_direct("a", encode_reply(7, "ok"))
    batch = cycle(engine)["a"]
    assert batch[0] == {"type": "reply", "id": 7, "result": "ok"}
    assert messages(batch) == list(range(8))


def test_the_setting_is_kept_as_auto_and_shown():
    config = TopicConfig(batch_depth="auto")
    assert config.batch_depth is AUTO_DEPTH and config.as_dict()["batch_depth"] == "auto"
    engine = Engine(EngineConfig(), instance_id="h")
    assert engine.create_topic("t", config).info()["batch_depth"] == "auto"


@pytest.mark.parametrize("value", ["fast", "AUTO", "", 0, -1, 1025, 2.0, True, None, [4]])
def test_a_bad_batch_depth_is_refused_with_a_clear_error(value):
    with pytest.raises(ValueError, match=r'batch_depth must be an integer in \[1, 1024\] or "auto"'):
        TopicConfig(batch_depth=value)


@pytest.mark.parametrize("kind", [TopicKind.PRIVATE, TopicKind.SNAPSHOT])
def test_auto_is_for_ring_topics_only(kind):
    with pytest.raises(ValueError, match='batch_depth "auto" is for ring topics'):
        TopicConfig(kind=kind, batch_depth="auto")


def test_depth_1_and_fixed_depths_are_unchanged_beside_auto():
    engine = auto_engine(budget=1 << 16)
    engine.create_topic("f4", TopicConfig(capacity=64, batch_depth=4))
    subscribed(engine, "a", "d8", "f4")
    for n in range(6):
        engine.publish("d8", n)
        engine.publish("f4", n)
    batch = cycle(engine)["a"]
    assert messages(batch, "d8") == [0] and messages(batch, "f4") == [0, 1, 2, 3]
