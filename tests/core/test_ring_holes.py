"""Given-up holes: when they are given up, how subscribers are told, and how a late retry is answered."""

from __future__ import annotations

import pytest

from core import Engine, EngineConfig, SkippedSeq, StaleSeq, TopicConfig, TopicRule
from core.errors import BadSeq
from tests.core.core_helpers import cycle

pytestmark = pytest.mark.unit


def engine(**config) -> Engine:
    return Engine(EngineConfig(rules=(TopicRule("*", TopicConfig(batch_depth=100, **config)),)), instance_id="h")


def tiles(entries: list[dict]) -> list[tuple]:
    """(kind, begin, end) runs of what a subscriber was told, in order."""
    out = []
    for e in entries:
        if e["type"] == "msg":
            out.append(("msg", e["seq"], e["seq"] + 1))
        elif e["type"] == "loss":
            out.append((e["reason"], e["from"], e["to"]))
    return out


def test_holes_noticed_together_are_given_up_after_one_timeout_not_one_each():
    e = engine(hole_timeout=1.0, reorder_window=64)
    e.connect("a")
    e.subscribe("a", "t")
    cycle(e)
    for seq in (2, 4, 6):
        e.publish("t", seq, seq=seq, now=0.0)
    assert e.tick(0.9) == 0
    assert e.tick(1.0) == 1
    assert tiles(cycle(e)["a"]) == [
        ("skipped", 0, 2),
        ("msg", 2, 3),
        ("skipped", 3, 4),
        ("msg", 4, 5),
        ("skipped", 5, 6),
        ("msg", 6, 7),
    ]


def test_a_later_hole_still_waits_its_own_timeout():
    e = engine(hole_timeout=1.0)
    e.connect("a")
    e.subscribe("a", "t")
    cycle(e)
    e.publish("t", 1, seq=1, now=0.0)
    e.publish("t", 3, seq=3, now=0.8)  # the hole at 2 is seen only at 0.8
    e.tick(1.0)
    assert tiles(cycle(e)["a"]) == [("skipped", 0, 1), ("msg", 1, 2)]
    e.tick(1.7)
    assert cycle(e) == {}
    e.tick(1.8)
    assert tiles(cycle(e)["a"]) == [("skipped", 2, 3), ("msg", 3, 4)]


def test_a_window_jump_past_the_ring_reports_never_published_seqs_as_skipped_not_lagged():
    e = engine(capacity=4, reorder_window=4)
    e.connect("a")
    e.subscribe("a", "t")
    cycle(e)
    e.publish("t", "one", seq=1)  # arrives, then is jumped over: it was published, so `lagged`
    e.publish("t", "twenty", seq=20)
    e.publish("t", "seventeen", seq=17)
    told = tiles(cycle(e)["a"])
    assert told[:3] == [("skipped", 0, 1), ("lagged", 1, 2), ("skipped", 2, 14)]
    covered = [seq for _, begin, end in told for seq in range(begin, end)]
    assert covered == list(range(covered[-1] + 1))  # msgs and loss notices tile the seq line
    assert ("msg", 17, 18) in told


def test_a_retry_of_a_given_up_seq_is_skipped_even_after_it_left_the_ring():
    e = engine(capacity=4, reorder_window=2)
    e.publish("t", "b", seq=1)
    e.publish("t", "d", seq=3)  # past the window: seq 0 and 2 are given up
    for seq in range(4, 40):
        e.publish("t", seq, seq=seq)
    with pytest.raises(SkippedSeq):
        e.publish("t", "late", seq=0)
    with pytest.raises(SkippedSeq):
        e.publish("t", "late", seq=2)
    with pytest.raises(StaleSeq):
        e.publish("t", "again", seq=3)  # it landed: a retry is idempotent


def test_reserve_stays_below_2_to_the_53():
    e = engine()
    assert e.reserve("t", 10) == (0, 10)
    with pytest.raises(BadSeq):
        e.reserve("t", 2**53)
