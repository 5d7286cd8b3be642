"""Private queues belong to an owner (a user), topics created by rules are reclaimed when unused, and data
that cannot be encoded is refused with a request error."""

from __future__ import annotations

import pytest

from core import RequestError, TopicConfig
from core.errors import CoreUsageError
from tests.core.core_helpers import cycle, decode, make_engine, messages

pytestmark = pytest.mark.unit


def test_a_second_connection_of_the_owner_takes_the_private_queue_over():
    engine = make_engine(max_count=8, batch_depth=4)
    engine.connect("tab1", owner="alice")
    engine.subscribe("tab1", "priv.q")
    cycle(engine)
    for i in range(3):
        engine.publish("priv.q", i, owner="alice")
    handed = engine.run_cycle()  # tab1 is handed 0..2 but its write never completes
    assert messages(decode(handed[0])) == [0, 1, 2]
    engine.publish("priv.q", 3, owner="alice")
    engine.connect("tab2", owner="alice")
    engine.subscribe("tab2", "priv.q")
    got = cycle(engine)
    assert got["tab2"][0]["type"] == "subscribed" and got["tab2"][0]["seq"] == 0
    assert messages(got["tab2"]) == [0, 1, 2, 3]  # uncommitted entries go again: nothing queued is lost
    engine.write_done("tab1")  # the old write completing later commits nothing of the moved queue
    got = cycle(engine)
    assert {"type": "closed", "topic": "priv.q", "reason": "taken_over"} in got["tab1"]
    assert "priv.q" not in engine.client("tab1").subs
    engine.disconnect("tab1")  # does not drop the queue tab2 now holds
    engine.publish("priv.q", 4, owner="alice")
    assert messages(cycle(engine)["tab2"]) == [4]


def test_owners_do_not_share_queues_and_the_owner_is_fixed_once_a_queue_is_held():
    engine = make_engine()
    engine.connect("a", owner="alice")
    engine.connect("b", owner="bob")
    engine.subscribe("a", "priv.q")
    engine.subscribe("b", "priv.q")
    engine.publish("priv.q", "for bob", owner="bob")
    got = cycle(engine)
    assert messages(got["b"]) == [0] and messages(got.get("a", [])) == []
    with pytest.raises(CoreUsageError):
        engine.set_owner("a", "bob")


def test_unused_rule_topics_are_reclaimed_after_the_ttl_and_kept_while_used_or_holding_data():
    engine = make_engine()
    engine.connect("a")
    for i in range(100):
        engine.subscribe("a", f"junk.{i}")
        engine.unsubscribe("a", f"junk.{i}")
    engine.subscribe("a", "kept.subscribed")
    engine.publish("kept.data", "x")
    engine.create_topic("kept.operator", TopicConfig())
    assert engine.reclaim(now=0.0, ttl=10.0) == []
    assert engine.reclaim(now=5.0, ttl=10.0) == []
    removed = engine.reclaim(now=10.0, ttl=10.0)
    assert sorted(removed) == sorted(f"junk.{i}" for i in range(100))
    assert sorted(t.name for t in engine.topics()) == ["kept.data", "kept.operator", "kept.subscribed"]
    engine.unsubscribe("a", "kept.subscribed")
    assert engine.reclaim(now=11.0, ttl=10.0) == []
    assert engine.reclaim(now=21.0, ttl=10.0) == ["kept.subscribed"]


def test_a_topic_subscribed_again_before_the_ttl_is_not_reclaimed():
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "t")
    engine.unsubscribe("a", "t")
    engine.reclaim(now=0.0, ttl=10.0)
    engine.subscribe("a", "t")
    assert engine.reclaim(now=20.0, ttl=10.0) == []
    assert engine.has_topic("t")


def test_data_nested_deeper_than_the_encoder_writes_is_a_request_error():
    engine = make_engine()
    deep: list = []
    for _ in range(600):
        deep = [deep]
    with pytest.raises(RequestError) as info:
        engine.publish("t", deep)
    assert info.value.code == "bad_data"
    engine.publish("t", "fine")


def test_a_refused_message_takes_no_seq_so_subscribers_see_no_false_loss():
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "t")
    cycle(engine)
    with pytest.raises(RequestError):
        engine.publish("t", _deep(600))
    assert engine.publish("t", "next").seq == 0
    engine.tick(now=10.0)
    assert [e["type"] for e in cycle(engine)["a"]] == ["msg"]


def _deep(levels: int):
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def test_a_private_queue_made_again_is_a_new_epoch_and_an_old_recovery_point_gets_a_loss_notice():
    engine = make_engine(max_count=8)
    engine.connect("tab1", owner="alice")
    engine.subscribe("tab1", "priv.q")
    first = cycle(engine)["tab1"][0]
    engine.publish("priv.q", "kept", owner="alice")
    cycle(engine)
    engine.publish("priv.q", "queued when tab1 left", owner="alice")
    engine.disconnect("tab1")  # the queue goes with what it held
    engine.connect("tab2", owner="alice")
    engine.subscribe("tab2", "priv.q", since=(first["epoch"], 1))
    got = cycle(engine)["tab2"]
    assert got[0]["type"] == "subscribed" and got[0]["seq"] == 0 and got[0]["epoch"] != first["epoch"]
    assert got[1] == {"type": "loss", "topic": "priv.q", "from": 1, "to": None, "reason": "epoch"}
    # a takeover keeps the queue and its epoch: a recovery point in it is no loss
    engine.connect("tab3", owner="alice")
    engine.subscribe("tab3", "priv.q", since=(got[0]["epoch"], 0))
    taken = cycle(engine)["tab3"]
    assert taken[0]["epoch"] == got[0]["epoch"] and [e["type"] for e in taken] == ["subscribed"]
