"""Join/leave announcements (gateway/presence.py): noted in O(1), sent once per cycle, a join and a leave of the
same member within a cycle cancel out, and a subscriber whose direct queue overflows is dropped only after the
announcing loop. A real engine; the kick is the scheduler's callable, recorded here."""

from __future__ import annotations

import orjson
import pytest

from core import Engine, EngineConfig, TopicConfig, TopicRule
from gateway.presence import FLUSH_INTERVAL_S, MAX_CHANGES_PER_FLUSH, Presence

pytestmark = pytest.mark.unit


class Room:
    def __init__(self, direct_queue_max: int = 1024, max_members: int = 1000) -> None:
        rules = (TopicRule("room.*", TopicConfig(presence=True, join_leave=True)),)
        self.engine = Engine(EngineConfig(rules=rules, direct_queue_max=direct_queue_max), instance_id="t")
        self.wakes = 0
        self.kicked: list[str] = []
        self.presence = Presence(self.engine, self.engine.send_direct, self.kick, max_members, self.wake)
        self.now = 0.0

    def flush(self) -> None:
        """The scheduler's flush, once the interval has passed."""
        self.now += FLUSH_INTERVAL_S
        self.presence.flush(self.now)

    def wake(self) -> None:
        self.wakes += 1

    def kick(self, client_id) -> None:  # what ClientRegistry.kick does, as far as presence sees it
        self.kicked.append(client_id)
        names = list(self.engine.client(client_id).subs)
        self.engine.disconnect(client_id)
        for name in names:
            self.presence.left(client_id, name)

    def join(self, client_id: str, topic: str = "room.1") -> None:
        if not self.engine.has_client(client_id):
            self.engine.connect(client_id, ready=False)
        self.engine.subscribe(client_id, topic)
        self.presence.joined(client_id, topic)

    def leave(self, client_id: str, topic: str = "room.1") -> None:
        self.engine.unsubscribe(client_id, topic)
        self.presence.left(client_id, topic)

    def entries(self, client_id: str) -> list[tuple[str, str]]:
        """The join/leave entries queued for `client_id`: (kind, member client)."""
        queued = self.engine.client(client_id).direct or ()
        return [(e["type"], e["client"]) for e in map(orjson.loads, queued) if e["type"] in ("join", "leave")]


def test_changes_are_sent_at_the_flush_and_a_toggle_within_a_cycle_sends_nothing():
    room = Room()
    for member in ("a", "b", "c"):
        room.join(member)
    assert room.entries("a") == []  # noted, not sent yet
    room.flush()
    assert room.entries("a") == [("join", "b"), ("join", "c")]  # its own join is not announced to it
    assert room.entries("c") == [("join", "a"), ("join", "b")]
    before = {m: room.entries(m) for m in ("a", "b", "c")}
    for _ in range(500):  # one client toggling its subscription within one cycle
        room.join("x")
        room.leave("x")
    room.flush()
    assert {m: room.entries(m) for m in ("a", "b", "c")} == before
    assert room.presence.cancelled == 1000
    # a leave then a join (a resubscribe) of a member the others know of cancels out too
    room.leave("b")
    room.join("b")
    room.flush()
    assert {m: room.entries(m) for m in ("a", "b", "c")} == before
    # across cycles every change is sent, in order
    room.join("x")
    room.flush()
    room.leave("x")
    room.flush()
    assert room.entries("a")[-2:] == [("join", "x"), ("leave", "x")]


def test_noting_costs_one_wake_and_nothing_per_subscriber():
    room = Room()
    for member in range(50):
        room.join(f"m{member}")
    room.flush()
    wakes = room.wakes
    room.join("x")
    assert room.wakes == wakes + 1
    assert sum(len(room.entries(f"m{m}")) for m in range(50)) == 49 * 50  # nothing new before the flush


def test_an_overflowing_subscriber_is_kicked_after_the_loop_and_its_leave_sent_at_the_next_flush():
    # direct queues of 4 entries: the 5th join overflows every member that does not read
    room = Room(direct_queue_max=4)
    for member in range(8):
        room.join(f"m{member}")
    room.flush()  # 7 joins each: every member overflowed
    assert sorted(room.kicked) == [f"m{m}" for m in range(8)]
    assert [c for c in room.engine.clients()] == []
    room.flush()  # their leaves: nobody is left to be told, and nothing raises
    assert room.presence.pending == {}


def test_an_overflow_amid_others_leaves_every_other_subscriber_served():
    room = Room(direct_queue_max=3)
    for member in ("a", "b", "c"):
        room.join(member)
    room.flush()  # 2 entries each
    for _ in range(2):  # a and b read theirs; c does not
        for member in ("a", "b"):
            room.engine.client(member).direct.clear()
    room.join("d")
    room.join("e")  # c gets its 3rd and 4th: overflow
    room.flush()
    assert room.kicked == ["c"]
    assert room.entries("a") == [("join", "d"), ("join", "e")]
    room.flush()  # c's leave
    assert room.entries("a") == [("join", "d"), ("join", "e"), ("leave", "c")]
    assert room.entries("e")[-1] == ("leave", "c")


def test_nothing_is_sent_above_the_members_bound_and_a_deleted_topic_forgets_its_changes():
    room = Room(max_members=3)
    for member in range(5):
        room.join(f"m{member}")
    room.flush()
    assert all(room.entries(f"m{m}") == [] for m in range(5))
    room.join("x", "room.2")
    room.presence.topic_gone("room.2")
    assert "room.2" not in room.presence.pending


def test_changes_go_at_most_once_per_interval_and_what_was_undone_meanwhile_not_at_all():
    room = Room()
    for member in ("a", "b"):
        room.join(member)
    room.flush()
    sent_at = room.now
    room.join("x")
    room.presence.flush(sent_at + FLUSH_INTERVAL_S / 2)  # a cycle within the interval: nothing goes yet
    assert room.entries("a") == [("join", "b")]
    assert room.presence.due_at() == sent_at + FLUSH_INTERVAL_S
    room.leave("x")  # undone before it went
    room.join("y")
    room.presence.flush(sent_at + FLUSH_INTERVAL_S)
    assert room.entries("a") == [("join", "b"), ("join", "y")]


def test_a_storm_of_joins_goes_out_a_bounded_slice_per_flush():
    room = Room()
    room.join("a")
    room.flush()
    storm = 2 * MAX_CHANGES_PER_FLUSH + 30
    for n in range(storm):
        room.join(f"s{n}")
    sizes = []
    for _ in range(3):
        wakes = room.wakes
        room.flush()
        sizes.append(len(room.entries("a")))
        if room.presence.pending:
            assert room.wakes == wakes + 1  # the rest is due at the next flush
    assert sizes == [MAX_CHANGES_PER_FLUSH, 2 * MAX_CHANGES_PER_FLUSH, storm]
    assert [client for _, client in room.entries("a")] == [f"s{n}" for n in range(storm)]
    assert room.kicked == [] and room.presence.pending == {}
