"""`linger` on shared topics: a publish holds the topic's caught-up subscribers back until `release`, so
what is published meanwhile reaches them together. Semantics only: nothing is lost or reordered by it, a
held subscriber is woken by its deadline, and a ring's linger ends before it could cost a loss."""

from __future__ import annotations

from typing import cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from core import Engine, EngineConfig, TopicConfig, TopicKind, TopicRule
from core.ring import RingTopic
from tests.core.core_helpers import cycle, messages

pytestmark = pytest.mark.unit

LINGER = 0.05
#: lingering rings: a small one (its linger ends early after 4 held messages), a default-sized auto one, one
#: at depth 1 (a subscriber is left behind); a ring without linger beside them
RINGS = {
    "l8": TopicConfig(capacity=8, batch_depth="auto", linger=LINGER),
    "l64": TopicConfig(capacity=64, batch_depth="auto", linger=LINGER / 2),
    "d16": TopicConfig(capacity=16, batch_depth=1, linger=LINGER * 2),
    "n8": TopicConfig(capacity=8, batch_depth=2),
}
CLIENTS = ["c0", "c1", "c2"]


def linger_engine() -> Engine:
    rules = (
        TopicRule("snap.*", TopicConfig(kind=TopicKind.SNAPSHOT, linger=LINGER)),
        *(TopicRule(name, config) for name, config in RINGS.items()),
    )
    return Engine(EngineConfig(rules=rules), instance_id="l")


class LingerMachine(RuleBasedStateMachine):
    """Publishes at model times, clocks moving on, releases, cycles with writes that stay pending: every
    seq still arrives or is announced lost, in order, and no held subscriber waits past its deadline."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = linger_engine()
        self.now = 0.0
        self.connected: dict[str, set[str]] = {}
        self.writing: set[str] = set()
        self.expect: dict[tuple[str, str], int] = {}
        #: when each seq of each ring was published
        self.published_at: dict[str, list[float]] = {t: [] for t in RINGS}

    @initialize()
    def start(self) -> None:
        for c in CLIENTS:
            self.engine.connect(c)
            self.connected[c] = set()
            for t in RINGS:
                self.subscribe(c, t)

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(sorted(RINGS)))
    def subscribe(self, c: str, t: str) -> None:
        if t not in self.connected[c]:
            self.expect[(c, t)] = self.engine.subscribe(c, t).seq
            self.connected[c].add(t)

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(sorted(RINGS)))
    def unsubscribe(self, c: str, t: str) -> None:
        if t in self.connected[c]:
            self.engine.unsubscribe(c, t)
            self.connected[c].discard(t)
            del self.expect[(c, t)]

    @rule(t=st.sampled_from(sorted(RINGS)), n=st.integers(1, 12))
    def publish(self, t: str, n: int) -> None:
        for _ in range(n):
            self.engine.publish(t, "x", now=self.now)
            self.published_at[t].append(self.now)

    @rule(dt=st.sampled_from([0.0, 0.01, 0.03, 0.05, 0.2]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def release(self) -> None:
        self.engine.release(self.now)

    @rule(c=st.sampled_from(CLIENTS))
    def finish_write(self, c: str) -> None:
        if c in self.writing:
            self.writing.discard(c)
            self.engine.write_done(c)

    @rule(complete=st.booleans())
    def run_cycle(self, complete: bool) -> None:
        for batch in self.engine.run_cycle():
            self._check(cast(str, batch.client_id), batch.entries)
            if complete:
                self.engine.write_done(batch.client_id)
            else:
                self.writing.add(cast(str, batch.client_id))

    @rule()
    def drain(self) -> None:
        """Once every linger is released and every write done, each subscriber reaches the end."""
        self.now += LINGER * 2
        self.engine.release(self.now)
        assert not self.engine.lingering
        for c in list(self.writing):
            self.engine.write_done(c)
        self.writing.clear()
        for _ in range(1000):
            batches = self.engine.run_cycle()
            if not batches:
                break
            for batch in batches:
                self._check(cast(str, batch.client_id), batch.entries)
                self.engine.write_done(batch.client_id)
        for (c, t), seq in self.expect.items():
            assert seq == cast(RingTopic, self.engine.topic(t)).end, (c, t)

    @invariant()
    def a_held_subscriber_waits_no_longer_than_its_linger(self) -> None:
        for t in RINGS:
            if not self.engine.has_topic(t):
                continue
            ring = cast(RingTopic, self.engine.topic(t))
            for sub in ring.idle:  # parked: caught up when parked, maybe held since
                if sub.cursor < ring.end:
                    assert ring.linger, "a topic without linger never holds a subscriber"
                    deadline = self.engine._lingering[ring]  # noqa: SLF001 (the topic's own deadline)
                    assert deadline <= self.published_at[t][sub.cursor] + ring.linger
                    assert (release := self.engine.next_release()) is not None and release <= deadline
                    # ... and a ring ends its linger before a held subscriber is half the ring behind
                    assert ring.end - sub.cursor < max(1, ring.capacity // 2)

    def _check(self, c: str, raw: list[bytes]) -> None:
        import orjson

        for entry in map(orjson.loads, raw):
            if entry["type"] not in ("msg", "loss"):
                continue
            key = (c, entry["topic"])
            if entry["type"] == "loss":
                assert entry["from"] == self.expect[key] and entry["reason"] == "lagged"
                self.expect[key] = entry["to"]
            else:
                assert entry["seq"] == self.expect[key]
                self.expect[key] += 1


TestLingerMachine = LingerMachine.TestCase
TestLingerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


# -- worked examples -----------------------------------------------------------------------------------------


def subscribed(*topics: str, client: str = "a") -> Engine:
    """An engine with `client` subscribed to `topics`, its `subscribed` entries read."""
    engine = linger_engine()
    engine.connect(client)
    for t in topics:
        engine.subscribe(client, t)
    cycle(engine)
    return engine


def test_publishes_within_the_linger_reach_a_caught_up_subscriber_in_one_batch():
    engine = subscribed("l64")
    for i in range(3):
        engine.publish("l64", i, now=10.0 + i * 0.01)  # its linger: 0.025 s
    assert engine.run_cycle() == [] and engine.lingering
    assert engine.next_release() == pytest.approx(10.025)
    assert engine.release(10.024) == 0 and engine.run_cycle() == []
    assert engine.release(10.025) == 1 and not engine.lingering
    assert messages(cycle(engine)["a"]) == [0, 1, 2]


def test_a_lagging_subscriber_is_not_held():
    engine = subscribed("d16", client="behind")  # depth 1: held messages leave it behind after a cycle
    for i in range(3):
        engine.publish("d16", i, now=1.0)  # its linger: 0.1 s
    engine.release(1.1)
    assert messages(cycle(engine)["behind"]) == [0]
    engine.connect("late")
    engine.subscribe("late", "d16")
    engine.publish("d16", 3, now=2.0)  # holds "late" (caught up), not "behind" (still reading)
    assert engine.lingering
    for seq in (1, 2, 3):
        assert messages(cycle(engine)["behind"]) == [seq]
    assert engine.lingering
    engine.release(2.1)
    assert messages(cycle(engine)["late"]) == [3]


def test_a_small_ring_ends_its_linger_at_half_the_ring_without_loss():
    engine = subscribed("l8")
    for i in range(3):
        engine.publish("l8", i, now=1.0)
    assert engine.lingering
    engine.publish("l8", 3, now=1.0)  # 4 held = half of 8: woken now, long before the deadline
    assert not engine.lingering
    assert messages(cycle(engine)["a"]) == [0, 1, 2, 3]


def test_a_snapshot_topic_with_linger_conflates_to_the_latest():
    engine = subscribed("snap.p")
    for i in range(5):
        engine.publish("snap.p", {"v": i}, now=1.0 + i * 0.001)
    assert engine.run_cycle() == []
    engine.release(1.06)
    got = cycle(engine)["a"]
    assert [e["data"] for e in got if e["type"] == "msg"] == [{"v": 4}]


def test_unsubscribe_and_delete_during_a_linger_leave_nothing_behind():
    engine = linger_engine()
    for c in ("a", "b"):
        engine.connect(c)
        engine.subscribe(c, "l64")
    cycle(engine)
    engine.publish("l64", 0, now=1.0)
    engine.unsubscribe("a", "l64")
    engine.release(2.0)
    assert list(cycle(engine)) == ["a", "b"]  # a: its `unsubscribed`; b: the message
    engine.publish("l64", 1, now=3.0)
    assert engine.lingering
    engine.delete_topic("l64")
    assert not engine.lingering and engine.next_release() is None


@pytest.mark.parametrize(
    "settings, error",
    [
        ({"linger": -0.01}, "linger must be a number of seconds in [0, 10]"),
        ({"linger": 10.5}, "linger must be a number of seconds in [0, 10]"),
        ({"linger": True}, "linger must be a number of seconds"),
        ({"kind": "private", "linger": 0.01}, "linger is for shared topics"),
    ],
)
def test_bad_linger_settings_are_refused(settings, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        TopicConfig(**settings)


def test_lingers_of_different_lengths_end_in_deadline_order():
    engine = subscribed("l8", "l64")
    engine.publish("l8", 0, now=0.0)  # linger 0.05: due at 0.05
    engine.publish("l64", 0, now=0.01)  # linger 0.025: due at 0.035, first
    assert engine.next_release() == pytest.approx(0.035)
    assert engine.release(0.04) == 1
    assert [e["topic"] for e in cycle(engine)["a"]] == ["l64"]
    for i in range(1, 4):  # l8 reaches half its ring: its linger ends now, not at 0.05
        engine.publish("l8", i, now=0.02)
    assert not engine.lingering and engine.next_release() is None
    assert messages(cycle(engine)["a"], "l8") == [0, 1, 2, 3]
    assert engine.release(1.0) == 0
