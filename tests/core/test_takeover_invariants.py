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

pytestmark = pytest.mark.unit

TABS = ["tab0", "tab1", "tab2"]
TOPIC = "p"


class TakeoverMachine(RuleBasedStateMachine):
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
    def connect(self, tab):
        if tab not in self.connected:
            self.engine.connect(tab, owner="alice")
            self.connected.add(tab)

    @rule(tab=st.sampled_from(TABS))
    def subscribe(self, tab):
        if tab in self.connected and tab != self.holder:
            self.engine.subscribe(tab, TOPIC)
            self.holder = tab
            self.holding += 1

    @rule(tab=st.sampled_from(TABS))
    def leave(self, tab):
        if tab in self.connected and tab != self.holder:  # the holder leaving frees the queue by design
            self.engine.disconnect(tab)
            self.connected.discard(tab)
            self.writing.pop(tab, None)

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
