"""What a node remembers of the seqs Redis accepted from it (gateway/broker/rewind.py), checked against a
Redis that came back behind: the highest per topic and epoch, a bounded number of topics."""

from __future__ import annotations

import pytest

from gateway.broker import rewind
from gateway.broker.keys import Keys

pytestmark = pytest.mark.unit


def test_the_floor_is_the_highest_accepted_seq_plus_one_of_the_latest_epoch():
    r = rewind.Rewinder(None, Keys("fanout"))  # the link is used by the checks only
    r.note_accepted("t", "E1", 4)
    r.note_accepted("t", "E1", 2)  # answers of one pipeline may be settled in any order
    assert r.accepted["t"] == ("E1", 5)
    r.note_accepted("t", "E2", 0)  # a new epoch replaces the old one's floor
    assert r.accepted["t"] == ("E2", 1)


def test_the_least_recently_published_topics_are_forgotten_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(rewind, "ACCEPTED_MAX", 3)
    r = rewind.Rewinder(None, Keys("fanout"))
    for name in ("a", "b", "c"):
        r.note_accepted(name, "E", 0)
    r.note_accepted("a", "E", 1)  # a is the most recent again
    r.note_accepted("d", "E", 0)
    assert list(r.accepted) == ["c", "a", "d"]
