"""The direct queue is bounded in bytes, per client and in all (issue 24: a count bound let one client that
never reads make the gateway hold 1,024 replies of any size)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from core import Engine, EngineConfig, TopicConfig, TopicKind, TopicRule
from core.errors import DirectQueueFull

pytestmark = pytest.mark.unit


def engine(**config) -> Engine:
    rules = (TopicRule("s*", TopicConfig(kind=TopicKind.SNAPSHOT)), TopicRule("*", TopicConfig()))
    return Engine(EngineConfig(rules=rules, **config), instance_id="t")


def test_a_client_is_cut_by_bytes_long_before_the_count():
    e = engine(direct_queue_max=1024, direct_queue_max_bytes=100_000)
    e.connect("a", ready=False)  # never reads
    reply = b"x" * 10_000
    for _ in range(10):
        e.send_direct("a", reply)
    with pytest.raises(DirectQueueFull):
        e.send_direct("a", reply)  # the 11th of 10 KB: past 100 KB, with 1,014 entries of count left
    assert e.client("a").direct_bytes == e.direct_bytes == 100_000


def test_the_total_cuts_big_queues_and_spares_small_ones():
    e = engine(direct_queue_max_bytes=1 << 20, direct_total_max_bytes=250_000, cycle_budget_bytes=20_000)
    for c in ("a", "b", "c"):
        e.connect(c, ready=False)
    for _ in range(10):
        e.send_direct("a", b"x" * 10_000)
        e.send_direct("b", b"x" * 10_000)
    e.send_direct("c", b"x" * 10_000)  # the total is 210 KB
    for _ in range(3):
        e.send_direct("c", b"x" * 10_000)  # 240 KB in all
    with pytest.raises(DirectQueueFull):
        e.send_direct("a", b"x" * 20_000)  # past the total, and a holds more than its budget
    e.send_direct("c", b"y" * 10_000)  # past the total too, but c's own queue is within its 20 KB budget
    e.disconnect("a")
    assert e.direct_bytes == 100_000 + 50_000


def test_draining_gives_the_bytes_back():
    e = engine(direct_queue_max_bytes=50_000, cycle_budget_bytes=1_000)
    e.connect("a")
    for _ in range(5):
        e.send_direct("a", b"x" * 10_000)
    while e.has_work:
        for batch in e.run_cycle():
            e.write_done(batch.client_id)
    assert e.client("a").direct_bytes == e.direct_bytes == 0
    e.send_direct("a", b"x" * 50_000)


CLIENTS = ["c0", "c1", "c2"]
TOPICS = ["r0", "r1", "s0"]


class DirectBytesMachine(RuleBasedStateMachine):
    """Whatever the verbs, each client's `direct_bytes` is the size of its queue, the engine's total is their
    sum, and no queue holds more than its bound plus what may pass it (`subscribed`, `closed`, notices)."""

    SLACK = 1_000  # entries the engine appends past the bound: a few hundred bytes each

    def __init__(self):
        super().__init__()
        self.engine = engine(direct_queue_max_bytes=2_000, direct_total_max_bytes=4_000, cycle_budget_bytes=500)
        self.connected: set[str] = set()

    @rule(c=st.sampled_from(CLIENTS), ready=st.booleans())
    def connect(self, c, ready):
        if c not in self.connected:
            self.engine.connect(c, ready=ready)
            self.connected.add(c)

    @rule(c=st.sampled_from(CLIENTS))
    def disconnect(self, c):
        self.engine.disconnect(c)
        self.connected.discard(c)

    @rule(c=st.sampled_from(CLIENTS), size=st.integers(1, 900))
    def reply(self, c, size):
        if c in self.connected:
            try:
                self.engine.send_direct(c, b"r" * size)
            except DirectQueueFull:
                self.engine.disconnect(c)  # what the gateway does: close 4009
                self.connected.discard(c)

    @rule(c=st.sampled_from(CLIENTS), t=st.sampled_from(TOPICS))
    def subscribe(self, c, t):
        if c in self.connected and t not in self.engine.client(c).subs:
            try:
                self.engine.subscribe(c, t)
            except DirectQueueFull:
                self.engine.disconnect(c)
                self.connected.discard(c)

    @rule(t=st.sampled_from(TOPICS))
    def delete(self, t):
        if self.engine.has_topic(t):
            self.engine.delete_topic(t)

    @rule(t=st.sampled_from(TOPICS))
    def publish(self, t):
        self.engine.publish(t, {"v": 1})

    @rule(c=st.sampled_from(CLIENTS))
    def ready(self, c):
        if c in self.connected:
            self.engine.mark_ready(c)

    @rule(done=st.booleans())
    def cycle(self, done):
        for batch in self.engine.run_cycle():
            if done:
                self.engine.write_done(batch.client_id)

    @invariant()
    def bytes_add_up(self):
        total = 0
        for client in self.engine.clients():
            assert client.direct_bytes == sum(len(entry) for entry in client.direct or ())
            assert client.direct_bytes <= 2_000 + self.SLACK
            total += client.direct_bytes
        assert self.engine.direct_bytes == total


TestDirectBytes = DirectBytesMachine.TestCase
TestDirectBytes.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
