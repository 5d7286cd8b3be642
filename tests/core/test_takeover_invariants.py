"""Hypothesis state machine: a user's private queue moving between that user's connections loses nothing.

Tabs of one user connect, take the queue over, are handed batches whose writes complete, fail or never
finish, and leave. While some connection holds the queue, it always holds exactly the published messages
not yet committed, in order, and what was committed is the published prefix: a takeover re-sends what the
old holder was handed but did not commit, and never drops or reorders a message.
"""

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from core import Engine, EngineConfig, QueueFull, TopicConfig, TopicKind, TopicRule
from core.errors import BadAck, NotSubscribed

pytestmark = pytest.mark.unit

TABS = ["tab0", "tab1", "tab2"]
TOPIC = "p"


class Tabs(RuleBasedStateMachine):
    """Tabs of one user connecting and leaving; the one holding the queue stays (its leaving frees the queue
    by design, without a broker). Subclasses keep `engine`, `connected`, `holder` and `writing`."""

    engine: Engine
    connected: set[str]
    holder: str | None
    writing: dict[str, tuple[list[int], int]]

    @rule(tab=st.sampled_from(TABS))
    def connect(self, tab):
        if tab not in self.connected:
            self.engine.connect(tab, owner="alice")
            self.connected.add(tab)

    @rule(tab=st.sampled_from(TABS))
    def leave(self, tab):
        if tab in self.connected and tab != self.holder:
            self.engine.disconnect(tab)
            self.connected.discard(tab)
            self.writing.pop(tab, None)


class TakeoverMachine(Tabs):
    def __init__(self):
        super().__init__()
        rules = (TopicRule("p", TopicConfig(kind=TopicKind.PRIVATE, max_count=4, batch_depth=2)),)
        self.engine = Engine(EngineConfig(rules=rules), instance_id="h")
        self.connected: set[str] = set()
        self.holder: str | None = None
        self.published = 0
        self.committed: list[int] = []
        #: per tab: the seqs of the batch it was handed and has not finished writing, and the holding it
        #: was handed under (a write that completes after its handle lost the queue commits nothing)
        self.writing: dict[str, tuple[list[int], int]] = {}
        self.holding = 0

    @rule(tab=st.sampled_from(TABS))
    def subscribe(self, tab):
        if tab in self.connected and tab != self.holder:
            self.engine.subscribe(tab, TOPIC)
            self.holder = tab
            self.holding += 1

    @rule()
    def publish(self):
        if self.holder is None:
            return
        try:
            self.engine.publish(TOPIC, self.published, owner="alice")
        except QueueFull:
            return
        self.published += 1

    @rule()
    def cycle(self):
        for batch in self.engine.run_cycle():
            seqs = [e["seq"] for e in map(orjson.loads, batch.entries) if e["type"] == "msg"]
            if seqs:
                assert batch.client_id == self.holder  # only the holder reads the queue
            self.writing[batch.client_id] = (seqs, self.holding)

    @rule(tab=st.sampled_from(TABS), written=st.booleans())
    def finish_write(self, tab, written):
        handed = self.writing.pop(tab, None)
        if handed is None:
            return
        seqs, holding = handed
        if written:
            self.engine.write_done(tab)
            if tab == self.holder and holding == self.holding:
                self.committed += seqs
        else:
            self.engine.rollback(tab)
            self.engine.mark_ready(tab)

    @invariant()
    def queue_is_the_uncommitted_rest(self):
        assert self.committed == list(range(len(self.committed)))
        if self.holder is None:
            return
        sub = self.engine.client(self.holder).subs[TOPIC]
        queued = [orjson.loads(entry)["seq"] for entry in sub.queue]
        assert queued == list(range(len(self.committed), self.published))


TestTakeover = TakeoverMachine.TestCase
TestTakeover.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class AckTakeoverMachine(Tabs):
    """The same user's tabs with acknowledged subscriptions (`ack`, docs/design/private-queues.md §9), some
    tabs subscribing without it: a written batch commits nothing of an acknowledged handle; `ack` removes the
    acknowledged prefix; a takeover (or a write that failed) hands every un-acknowledged entry out again.

    Checked: nothing acknowledged is delivered again, nothing un-acknowledged leaves the queue (across
    takeovers and failed writes), each tab receives consecutive seqs starting at the queue's head, and the
    queue stays within its bounds (count and bytes) however far the client is from acknowledging."""

    MAX_COUNT = 4
    MAX_BYTES = 120

    def __init__(self):
        super().__init__()
        config = TopicConfig(kind=TopicKind.PRIVATE, max_count=self.MAX_COUNT, max_bytes=self.MAX_BYTES, batch_depth=2)
        self.engine = Engine(EngineConfig(rules=(TopicRule("p", config),)), instance_id="h")
        self.connected: set[str] = set()
        self.holder: str | None = None
        self.holder_acks = False
        self.published = 0
        #: first seq still queued: everything below it was committed (acknowledged, or written without ack)
        self.head = 0
        #: per tab in its current holding: the next seq it should be handed
        self.next: dict[str, int] = {}
        self.writing: dict[str, tuple[list[int], int]] = {}
        self.holding = 0
        self.connect("tab0")
        self.subscribe("tab0", True)

    @rule(tab=st.sampled_from(TABS), ack=st.booleans())
    def subscribe(self, tab, ack):
        if tab in self.connected and tab != self.holder:
            result = self.engine.subscribe(tab, TOPIC, ack=ack)
            if self.holder is not None:
                assert result.seq == self.head, "a takeover starts elsewhere than the first un-acknowledged entry"
            else:  # a new queue starts at the next seq
                self.head = self.published
                assert result.seq == self.head
            if self.holder is not None:
                self.next.pop(self.holder, None)
            self.holder, self.holder_acks = tab, ack
            self.next[tab] = self.head
            self.holding += 1

    @rule(size=st.integers(1, 60))
    def publish(self, size):
        if self.holder is None:
            return
        try:
            self.engine.publish(TOPIC, "x" * size, owner="alice")
        except QueueFull:
            return
        self.published += 1

    @rule()
    def cycle(self):
        for batch in self.engine.run_cycle():
            seqs = [e["seq"] for e in map(orjson.loads, batch.entries) if e["type"] == "msg"]
            if seqs:
                assert batch.client_id == self.holder  # only the holder reads the queue
                for seq in seqs:
                    assert seq >= self.head, f"seq {seq} was acknowledged (head {self.head}) and came again"
                    assert seq == self.next[self.holder], "out of order, skipped or doubled within a holding"
                    self.next[self.holder] += 1
            self.writing[batch.client_id] = (seqs, self.holding)

    @rule(tab=st.sampled_from(TABS), written=st.booleans())
    def finish_write(self, tab, written):
        handed = self.writing.pop(tab, None)
        if handed is None:
            return
        seqs, holding = handed
        current = tab == self.holder and holding == self.holding
        if written:
            self.engine.write_done(tab)
            if current and not self.holder_acks and seqs:
                self.head = seqs[-1] + 1
        else:
            self.engine.rollback(tab)
            self.engine.mark_ready(tab)
            if current:
                self.next[tab] = self.head  # everything not committed is handed out again

    @rule(n=st.integers(1, 4))
    def flow(self, n):
        """Publish, deliver and write a few in one step (the common path, so that acks have much to do)."""
        for _ in range(n):
            self.publish(20)
        self.cycle()
        for tab in list(self.writing):
            self.finish_write(tab, True)

    @rule(tab=st.sampled_from(TABS))
    def ack_elsewhere(self, tab):
        """A tab that lost the queue (or never had it) has no subscription to acknowledge."""
        if tab in self.connected and tab != self.holder:
            with pytest.raises(NotSubscribed):
                self.engine.ack(tab, TOPIC, 0)

    @rule(back=st.integers(-2, 5))
    def ack(self, back):
        """The holder acknowledges up to `back` below the last seq it was handed (negative: past it)."""
        if self.holder is None:
            return
        delivered = self.next[self.holder]  # seqs below it were handed out in this holding
        seq = delivered - 1 - back
        if not self.holder_acks or seq >= delivered:
            with pytest.raises(BadAck):
                self.engine.ack(self.holder, TOPIC, seq)
            return
        assert self.engine.ack(self.holder, TOPIC, seq) == max(self.head, seq + 1)
        self.head = max(self.head, seq + 1)

    @invariant()
    def queue_is_the_unacknowledged_rest_within_bounds(self):
        if self.holder is None:
            return
        sub = self.engine.client(self.holder).subs[TOPIC]
        queued = [orjson.loads(entry)["seq"] for entry in sub.queue]
        assert queued == list(range(self.head, self.published))
        assert len(queued) <= self.MAX_COUNT
        assert len(queued) <= 1 or sub.queued_bytes <= self.MAX_BYTES
        assert sub.queued_bytes == sum(map(len, sub.queue))


TestAckTakeover = AckTakeoverMachine.TestCase
TestAckTakeover.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
