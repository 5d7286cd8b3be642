"""The chaos run's invariant checker (loadtest/chaos_check.py) on synthetic records."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.chaos_check import check_all, check_consistency, check_private, check_ring_holds, check_stream

pytestmark = pytest.mark.unit


def sub(epoch: str, seq: int, kind: str = "ring") -> dict:
    return {"ev": "sub", "epoch": epoch, "seq": seq, "kind": kind}


def msg(seq: int, p: str = "a", n: int | None = None) -> dict:
    return {"ev": "msg", "seq": seq, "data": {"p": p, "n": seq if n is None else n}}


def loss(a: int, b: int | None, reason: str = "lagged") -> dict:
    return {"ev": "loss", "from": a, "to": b, "reason": reason}


def kinds(violations: list) -> list[tuple[str, int | None, int | None]]:
    return [(v.kind, v.from_seq, v.to_seq) for v in violations]


def test_messages_and_losses_that_tile_the_line_pass_across_reconnects_and_epochs() -> None:
    events = [
        sub("e1", 0),
        msg(0),
        msg(1),
        loss(2, 5),
        msg(5),
        sub("e1", 6),
        loss(6, 9, "gone"),
        msg(9),  # a reconnect with since, some gone
        sub("e2", 0),
        loss(10, None, "epoch"),
        msg(0),
        msg(1),  # Redis came back empty
        loss(2, None, "epoch"),
        sub("e3", 4),
        msg(4),
    ]  # the unasked form: loss first
    found, stats = check_stream("c", "t", "ring", events)
    assert found == []
    assert stats.messages == 7 and stats.losses == {"lagged": 1, "gone": 1, "epoch": 2} and stats.lost_seqs == 6


def test_a_gap_a_duplicate_an_overlap_and_a_silent_epoch_are_each_reported_with_their_range() -> None:
    found, _ = check_stream("c", "t", "ring", [sub("e1", 0), msg(0), msg(3), msg(3), loss(2, 6), msg(6), sub("e2", 0), msg(0)])
    assert kinds(found) == [("gap", 1, 3), ("duplicate", 3, 4), ("overlap", 2, 4), ("silent_epoch", 0, None)]
    assert "client c topic t [1, 3)" in str(found[0])


def test_a_loss_that_starts_past_the_next_seq_is_a_gap_before_it() -> None:
    found, _ = check_stream("c", "t", "ring", [sub("e1", 10), msg(10), loss(13, 20), msg(20)])
    assert kinds(found) == [("gap", 11, 13)]


def test_snapshot_jumps_are_conflation_but_going_back_is_not() -> None:
    ok, stats = check_stream("c", "s", "snapshot", [sub("e", 4), msg(4), msg(9), sub("e", 10), msg(9), msg(12)])
    assert ok == [] and stats.repeats == 1
    bad, _ = check_stream("c", "s", "snapshot", [sub("e", 4), msg(4), msg(9), msg(7)])
    assert kinds(bad) == [("backwards", 7, 8)]


def test_private_redeliveries_after_a_takeover_are_counted_a_gap_is_not_allowed() -> None:
    events = [
        sub("q", 0, "private"),
        msg(0),
        msg(1),
        msg(2),
        {"ev": "closed", "reason": "taken_over"},
        sub("q", 1, "private"),
        msg(1),
        msg(2),
        msg(3),
        msg(5),
    ]
    found, stats = check_stream("c", "private.x", "private", events)
    assert kinds(found) == [("gap", 4, 5)] and stats.redelivered == 2 and stats.closed == {"taken_over": 1}
    dup, _ = check_stream("c", "private.x", "private", [sub("q", 0, "private"), msg(0), msg(1), msg(1)])
    assert kinds(dup) == [("duplicate", 1, 2)]


def test_private_every_accepted_publish_reaches_one_of_the_users_connections() -> None:
    one = [sub("q", 0, "private"), msg(0, "adm", 0), msg(1, "adm", 1)]
    two = [sub("q", 2, "private"), msg(2, "adm", 2), msg(3, "adm", 4)]
    accepted = [("adm", n, 100.0 + n) for n in range(6)]
    found, expected = check_private("u", "private.x", {"w1": one, "w2": two}, accepted)
    assert kinds(found) == [("private_missing", 3, 4), ("private_missing", 5, 6)] and expected == []
    # announced as lost afterwards: excused; accepted just before a wipe: expected, listed apart
    lost = {"w1": one, "w2": [*two, {"ev": "closed", "reason": "lost", "t": 200.0}]}
    assert check_private("u", "private.x", lost, accepted) == ([], [])
    found, expected = check_private("u", "private.x", {"w1": one, "w2": two}, accepted, wipes=[105.5], wipe_window_s=3.0)
    assert kinds(found) == [] and kinds(expected) == [("private_lost_in_wipe", 3, 4), ("private_lost_in_wipe", 5, 6)]
    out_of_order = {"w1": [sub("q", 0, "private"), msg(0, "adm", 1), msg(1, "adm", 0)]}
    assert kinds(check_private("u", "p", out_of_order, [])[0]) == [("private_order", 0, 1)]


def test_the_same_seq_must_carry_the_same_message_everywhere() -> None:
    records = {
        "a": {"t": [sub("e", 0), msg(0, n=0), msg(1, n=1)]},
        "b": {"t": [sub("e", 1), msg(1, n=7)]},
        "c": {"t": [sub("f", 1), msg(1, n=9)]},
    }  # another epoch: another message
    assert kinds(check_consistency(records, {"t": "ring"})) == [("mismatch", 1, 2)]


def test_every_accepted_message_newer_than_the_oldest_held_is_in_the_ring() -> None:
    ring = [msg(10, "ing", 3), msg(11, "adm", 0), msg(12, "ing", 4), msg(13, "ing", 6)]
    found = check_ring_holds("t", ring, {"ing": [0, 1, 2, 3, 4, 5, 6, 7], "adm": [0]})
    assert kinds(found) == [("ring_missing", 5, 6), ("ring_missing", 7, 8)]
    assert kinds(check_ring_holds("t", [msg(1, "ing", 4), msg(2, "ing", 3)], {})) == [("ring_order", 3, 4)]


def test_a_record_whose_outcome_its_publisher_never_learned_may_land_after_newer_ones() -> None:
    # the publisher gave up on n=3 at one node and published n=4 and 5 at another; the first node published
    # n=3 once its broker was back: no order was promised for it, but every other pair keeps its order
    ring = [msg(1, "ing", 4), msg(2, "ing", 3), msg(3, "ing", 5)]
    assert kinds(check_ring_holds("t", ring, {"ing": [4, 5]}, {"ing": [3]})) == []
    ring = [msg(1, "ing", 5), msg(2, "ing", 3), msg(3, "ing", 4)]
    assert kinds(check_ring_holds("t", ring, {"ing": [4, 5]}, {"ing": [3]})) == [("ring_order", 4, 5)]


def test_check_all_puts_it_together() -> None:
    records = {"w": {"r": [sub("e", 0), msg(0), msg(1)], "private.q": [sub("q", 0, "private"), msg(0, "adm", 0)]}}
    result = check_all(
        records,
        {"r": "ring", "private.q": "private"},
        {"w": "u"},
        {("u", "private.q"): [("adm", 0, 1.0), ("adm", 1, 2.0)]},
        {"r": [msg(0), msg(1)]},
        {"r": {"a": [0, 1]}},
    )
    assert kinds(result.violations) == [("private_missing", 1, 2)]
    assert result.as_json()["streams"]["w"]["r"]["messages"] == 2


def test_a_chaos_client_subscribes_again_to_the_private_queues_redis_lost_and_only_those() -> None:
    from loadtest.chaos_clients import lost_queues

    entries: list[dict[str, Any]] = [
        {"type": "closed", "topic": "private.a", "reason": "lost"},
        {"type": "closed", "topic": "private.b", "reason": "taken_over"},
        {"type": "closed", "topic": "chaos.ring.0", "reason": "lost"},  # not one of its private topics
        {"type": "msg", "topic": "private.a", "seq": 3, "data": 1},
    ]
    assert lost_queues(entries, {"private.a", "private.b"}) == ["private.a"]
