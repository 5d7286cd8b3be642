"""Hypothesis state machines for the engine's invariants (STYLE.md pattern 8)."""

import itertools

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from core import Engine, EngineConfig, QueueFull, TopicConfig, TopicKind, TopicRule
from core.errors import BadAck

pytestmark = pytest.mark.unit

CLIENTS = ["c0", "c1", "c2"]
RINGS = ["r0", "r1"]
SNAP = "s0"
PRIV = "p0"
PRIV_MAX = 3
DIRECT_TYPES = {"subscribed", "unsubscribed", "reply", "closed"}


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        rules = (
            TopicRule("r*", TopicConfig(capacity=4)),
            TopicRule("s*", TopicConfig(kind=TopicKind.SNAPSHOT)),
            TopicRule("p*", TopicConfig(kind=TopicKind.PRIVATE, max_count=PRIV_MAX)),
        )
        self.engine = Engine(EngineConfig(rules=rules, cycle_budget_bytes=300), instance_id="h")
        self.connected: dict[str, set[str]] = {}
        self.ready: dict[str, bool] = {}
        self.writing: dict[str, list] = {}
        #: next seq each (client, shared topic) expects: every seq is either delivered or announced lost
        self.expect: dict[tuple[str, str], int] = {}
        #: private queue model: seqs published and not yet committed, and how many are handed out
        self.queue: dict[str, list[int]] = {}
        self.handed: dict[str, int] = {}
        self.committed: dict[str, list[int]] = {}
        self.private_next: dict[str, int] = {}
        #: clients whose private subscription was made with `ack`: entries leave on `ack`, not on the write
        self.acking: set[str] = set()
        self.ticks = itertools.count()

    # -- clients -----------------------------------------------------------------------------------------

    @rule(c=st.sampled_from(CLIENTS), ready=st.booleans())
    def connect(self, c, ready):
        if c in self.connected:
            return
        self.engine.connect(c, ready=ready)
        self.connected[c] = set()
        self.ready[c] = ready

    @rule(c=st.sampled_from(CLIENTS))
    def disconnect(self, c):
        if c not in self.connected:
            return
        self.engine.disconnect(c)
        for t in self.connected.pop(c):
            self.expect.pop((c, t), None)
        self.queue.pop(c, None)
        self.writing.pop(c, None)

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(RINGS + [SNAP, PRIV]), ack=st.booleans())
    def subscribe(self, c, t, ack):
        if c not in self.connected or t in self.connected[c]:
            return
        result = self.engine.subscribe(c, t, ack=ack)
        self.connected[c].add(t)
        if t == PRIV:
            self.queue[c], self.handed[c], self.committed[c], self.private_next[c] = [], 0, [], 0
            if ack:
                self.acking.add(c)
            else:
                self.acking.discard(c)
        elif t != SNAP:
            self.expect[(c, t)] = result.seq

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(RINGS + [SNAP, PRIV]))
    def unsubscribe(self, c, t):
        if c not in self.connected or t not in self.connected[c]:
            return
        self.engine.unsubscribe(c, t)
        self.connected[c].discard(t)
        self.expect.pop((c, t), None)
        if t == PRIV:
            self.queue.pop(c, None)

    # -- publishing ----------------------------------------------------------------------------------------

    @rule(t=st.sampled_from(RINGS + [SNAP]), n=st.integers(1, 6))
    def publish_shared(self, t, n):
        for _ in range(n):
            self.engine.publish(t, "x")

    @rule(c=st.sampled_from(CLIENTS))
    def publish_private(self, c):
        if PRIV not in self.connected.get(c, ()):
            return
        full = len(self.queue[c]) >= PRIV_MAX
        try:
            seq = self.engine.publish(PRIV, "y", owner=c).seq
        except QueueFull:
            assert full, "back-pressure reported while the queue had room"
            return
        assert not full, "a full queue accepted a message"
        assert seq == self.private_next[c]
        self.private_next[c] += 1
        self.queue[c].append(seq)

    # -- scheduling ----------------------------------------------------------------------------------------

    @rule(c=st.sampled_from(CLIENTS))
    def mark_ready(self, c):
        if c in self.connected and c not in self.writing:
            self.engine.mark_ready(c)
            self.ready[c] = True

    @rule(c=st.sampled_from(CLIENTS))
    def mark_idle(self, c):
        if c in self.connected and c not in self.writing:
            self.engine.mark_idle(c)
            self.ready[c] = False

    @rule(c=st.sampled_from(CLIENTS), ok=st.booleans())
    def finish_write(self, c, ok):
        if c not in self.writing:
            return
        del self.writing[c]
        if c in self.queue:
            if c in self.acking:  # a write commits nothing: only `ack` does; a failed one hands all again
                if not ok:
                    self.handed[c] = 0
            elif ok:
                k = self.handed[c]
                self.committed[c] += self.queue[c][:k]
                del self.queue[c][:k]
                self.handed[c] = 0
            else:
                self.handed[c] = 0
        if ok:
            self.engine.write_done(c)
        else:
            self.engine.rollback(c)
            self.engine.mark_ready(c)
        self.ready[c] = True

    @rule(c=st.sampled_from(CLIENTS), back=st.integers(-2, 4))
    def ack(self, c, back):
        """A cumulative ack of the private queue: `back` below the last seq handed out (negative: past it)."""
        if c not in self.queue:
            return
        head = self.private_next[c] - len(self.queue[c])
        seq = head + self.handed[c] - 1 - back
        if c not in self.acking:
            with pytest.raises(BadAck):
                self.engine.ack(c, PRIV, seq)
            return
        count = seq - head + 1
        if count > self.handed[c]:
            with pytest.raises(BadAck):
                self.engine.ack(c, PRIV, seq)
            return
        first_queued = self.engine.ack(c, PRIV, seq)
        if count > 0:
            self.committed[c] += self.queue[c][:count]
            del self.queue[c][:count]
            self.handed[c] -= count
        assert first_queued == self.private_next[c] - len(self.queue[c])

    @invariant()
    def private_queues_hold_exactly_the_unacknowledged_rest(self):
        for c, queued in self.queue.items():
            sub = self.engine.client(c).subs[PRIV]
            assert [orjson.loads(e)["seq"] for e in sub.queue] == queued
            assert len(queued) <= PRIV_MAX and sub.peeked == self.handed[c]

    @rule()
    def run_cycle(self):
        batches = self.engine.run_cycle()
        seen = set()
        for batch in batches:
            c = batch.client_id
            assert c not in seen, "a client appears twice in one cycle"
            seen.add(c)
            assert c in self.connected and self.ready[c] and c not in self.writing, "not-ready client got data"
            self.check_batch(c, [orjson.loads(e) for e in batch.entries])
            self.writing[c] = batch

    def check_batch(self, c, entries):
        assert entries
        topics_seen = []
        direct_done = False
        for e in entries:
            kind = e["type"]
            if kind in DIRECT_TYPES:
                assert not direct_done, "a direct entry came after topic entries"
                continue
            if kind == "msg" and e["topic"] == SNAP and not direct_done:
                continue  # the state-of-the-world snapshot rides the direct queue
            direct_done = True
            t = e["topic"]
            if t == PRIV:
                assert kind == "msg"
                assert e["seq"] == self.queue[c][self.handed[c]], "private entry out of order, lost or doubled"
                self.handed[c] += 1
                topics_seen.append(t)
            elif t in RINGS:
                key = (c, t)
                if kind == "loss":
                    assert e["from"] == self.expect[key] < e["to"], "loss notice does not start where we are"
                    self.expect[key] = e["to"]
                else:
                    assert e["seq"] == self.expect[key], f"ring {t}: got {e['seq']} expected {self.expect[key]}"
                    self.expect[key] += 1
                    topics_seen.append(t)
            else:
                topics_seen.append(t)
        assert len(topics_seen) == len(set(topics_seen)), "two messages of one topic in a cycle at depth 1"

    @invariant()
    def committed_private_messages_are_exactly_the_published_prefix(self):
        for done in self.committed.values():
            assert done == list(range(len(done)))

    @invariant()
    def active_set_holds_only_ready_clients_with_work(self):
        for client in self.engine._active:
            assert client.state.value == "ready" and client.has_work()

    @invariant()
    def ring_storage_is_bounded(self):
        for t in RINGS:
            if t in self.engine._topics:
                topic = self.engine.topic(t)
                assert topic.end - topic.begin <= topic.capacity == len(topic.slots)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class ReorderMachine(RuleBasedStateMachine):
    """Out-of-order publishes: delivered in order; holes beyond the window become exact loss notices."""

    WINDOW = 5

    def __init__(self):
        super().__init__()
        self.engine = Engine(
            EngineConfig(rules=(TopicRule("*", TopicConfig(capacity=64, reorder_window=self.WINDOW)),)),
            instance_id="r",
        )
        self.engine.connect("c")
        self.engine.subscribe("c", "t")
        self.published: set[int] = set()
        self.delivered: list[int] = []
        self.lost: set[int] = set()
        self.expect = 0

    @rule(seq=st.integers(0, 40))
    def publish(self, seq):
        topic = self.engine.topic("t")
        try:
            self.engine.publish("t", seq, seq=seq)
        except Exception as exc:
            assert exc.code in ("duplicate_seq", "stale_seq", "skipped_seq")
            assert seq in self.published or seq < topic.end
            return
        assert seq not in self.published
        self.published.add(seq)

    @rule()
    def cycle(self):
        for batch in self.engine.run_cycle():
            for e in map(orjson.loads, batch.entries):
                if e["type"] == "msg":
                    assert e["seq"] == self.expect
                    self.delivered.append(e["seq"])
                    self.expect += 1
                elif e["type"] == "loss":
                    assert e["from"] == self.expect < e["to"]
                    self.lost.update(range(e["from"], e["to"]))
                    self.expect = e["to"]
            self.engine.write_done("c")

    @invariant()
    def every_delivered_seq_was_published_and_no_lost_seq_was(self):
        assert set(self.delivered) <= self.published
        assert not (self.lost & set(self.delivered))
        # a seq is given up only when a seq >= it + window arrived
        if self.lost:
            assert max(self.published) >= max(self.lost) + self.WINDOW


TestReorderMachine = ReorderMachine.TestCase
TestReorderMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


from hypothesis import given  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.permutations(list(range(12))), st.integers(12, 20))
def test_any_permutation_within_the_window_is_delivered_in_order(order, window):
    engine = Engine(EngineConfig(rules=(TopicRule("*", TopicConfig(reorder_window=window)),)), instance_id="p")
    engine.connect("c")
    engine.subscribe("c", "t")
    seen = []
    for seq in order:
        engine.publish("t", seq, seq=seq)
        for batch in engine.run_cycle():
            seen += [orjson.loads(e) for e in batch.entries]
            engine.write_done("c")
    while batches := engine.run_cycle():
        for batch in batches:
            seen += [orjson.loads(e) for e in batch.entries]
            engine.write_done("c")
    assert [e["seq"] for e in seen if e["type"] == "msg"] == list(range(12))
    assert not [e for e in seen if e["type"] == "loss"]
