"""Join/leave declined per subscription (gateway/presence.py `decline_join_leave`, a Centrifugo `subscribe`
without `join_leave`): no entry queued for the client that declined, the others unchanged; the table is
forgotten as the client leaves the topic or goes, and holds at most the bound + 1 topics a client."""

from __future__ import annotations

import pytest

from tests.gateway.test_presence_flush import Room

pytestmark = pytest.mark.unit


def test_a_client_that_declined_gets_no_join_or_leave_and_the_others_do():
    room = Room()
    room.presence.decline_join_leave("quiet", "room.1", True, 10)
    room.join("quiet")
    room.join("loud")
    room.flush()
    room.join("c")
    room.flush()
    room.leave("c")
    room.flush()
    assert room.entries("quiet") == []
    assert room.entries("loud")[-2:] == [("join", "c"), ("leave", "c")]


def test_asking_again_undoes_a_decline_and_leaving_forgets_it():
    room = Room()
    presence = room.presence
    presence.decline_join_leave("q", "room.1", True, 10)
    presence.decline_join_leave("q", "room.1", False, 10)
    assert presence.declined == {}
    presence.decline_join_leave("q", "room.1", True, 10)
    room.join("q")
    room.leave("q")
    assert presence.declined == {}
    presence.decline_join_leave("q", "room.2", True, 10)
    presence.forget("q")
    assert presence.declined == {}


def test_the_table_is_bounded_by_the_subscriptions():
    room = Room()
    presence = room.presence
    room.join("q", "room.kept")
    presence.decline_join_leave("q", "room.kept", True, 4)
    for n in range(100):  # subscribes refused (never joined): stale declines, pruned when the bound is met
        presence.decline_join_leave("q", f"room.{n}", True, 4)
        assert len(presence.declined["q"]) <= 5
    assert "room.kept" in presence.declined["q"]
