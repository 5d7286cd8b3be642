"""Unit tests of the engine: topics, loss notices, snapshots, private queues, the scheduler's rules."""

import orjson
import pytest

from core import (
    DirectQueueFull,
    DuplicateSeq,
    Engine,
    EngineConfig,
    QueueFull,
    SkippedSeq,
    StaleSeq,
    TopicConfig,
    UnknownTopic,
    encode_reply,
)
from tests.core.core_helpers import cycle, decode, make_engine, messages

pytestmark = pytest.mark.unit


def test_a_message_is_encoded_once_and_shared_by_every_subscriber():
    engine = make_engine()
    for c in range(3):
        engine.connect(c)
        engine.subscribe(c, "t")
    cycle(engine)
    engine.publish("t", {"p": 1})
    batches = engine.run_cycle()
    assert len(batches) == 3
    first = batches[0].entries[0]
    assert all(b.entries[0] is first for b in batches)
    assert orjson.loads(first) == {"type": "msg", "topic": "t", "seq": 0, "data": {"p": 1}}


def test_ack_then_messages_in_seq_order_and_subscribe_at_head():
    engine = make_engine()
    engine.publish("t", "before")  # auto-created by the "*" rule
    engine.connect("a")
    sub = engine.subscribe("a", "t", request_id=7)
    assert sub.seq == 1
    got = cycle(engine)["a"]
    assert got == [{"type": "subscribed", "topic": "t", "kind": "ring", "epoch": sub.epoch, "seq": 1, "id": 7}]
    for i in range(3):
        engine.publish("t", i)
    seen = []
    for _ in range(3):
        seen += messages(cycle(engine)["a"])
    assert seen == [1, 2, 3]


def test_a_lagging_subscriber_gets_the_exact_missed_range_then_continues_at_the_oldest():
    engine = make_engine(capacity=4)
    engine.connect("slow")
    engine.subscribe("slow", "t")
    cycle(engine)
    for i in range(10):
        engine.publish("t", i)
    got = cycle(engine)["slow"]
    assert got[0] == {"type": "loss", "topic": "t", "from": 0, "to": 6, "reason": "lagged"}
    assert messages(got) == [6]
    assert engine.counters.messages_lost == 6


def test_recovery_from_a_retained_point_replays_from_there():
    engine = make_engine(capacity=8)
    epoch = engine.create_topic("t").epoch
    for i in range(6):
        engine.publish("t", i)
    engine.connect("a")
    assert engine.subscribe("a", "t", since=(epoch, 3)).seq == 3
    seen = []
    for _ in range(4):
        seen += messages(cycle(engine).get("a", []))
    assert seen == [3, 4, 5]


def test_recovery_from_a_point_that_is_gone_or_of_another_epoch_is_announced():
    engine = make_engine(capacity=4)
    epoch = engine.create_topic("t").epoch
    for i in range(10):
        engine.publish("t", i)
    engine.connect("a")
    engine.subscribe("a", "t", since=(epoch, 2))
    got = cycle(engine)["a"]
    assert got[1] == {"type": "loss", "topic": "t", "from": 2, "to": 6, "reason": "gone"}
    assert messages(got) == [6]
    engine.connect("b")
    engine.subscribe("b", "t", since=("old-epoch", 5))
    got = cycle(engine)["b"]
    assert got[1] == {"type": "loss", "topic": "t", "from": 5, "to": None, "reason": "epoch"}
    assert messages(got) == [6]


def test_snapshot_new_subscriber_gets_latest_at_once_and_a_laggard_only_the_latest():
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "snap.x")
    cycle(engine)
    for i in range(5):
        engine.publish("snap.x", {"v": i})
    got = cycle(engine)["a"]
    assert [(e["seq"], e["data"]) for e in got] == [(4, {"v": 4})]  # conflated: seq tells 4 were skipped
    engine.connect("b")
    engine.subscribe("b", "snap.x")
    got = cycle(engine)["b"]
    assert [e["type"] for e in got] == ["subscribed", "msg"] and got[1]["seq"] == 4
    assert cycle(engine) == {}


def test_private_queue_back_pressure_peek_commit_and_rollback():
    engine = make_engine(max_count=3, batch_depth=2)
    engine.connect("a")
    engine.subscribe("a", "priv.q")
    cycle(engine)
    for i in range(3):
        engine.publish("priv.q", i, owner="a")
    with pytest.raises(QueueFull):
        engine.publish("priv.q", 3, owner="a")
    assert engine.counters.back_pressure_events == 1
    batch = engine.run_cycle()[0]
    assert messages(decode(batch)) == [0, 1]  # batch depth 2
    engine.rollback("a")  # the write failed: nothing was lost
    engine.mark_ready("a")
    assert messages(decode(engine.run_cycle()[0])) == [0, 1]
    assert engine.take_space_freed() == []
    engine.commit("a")
    assert engine.take_space_freed() == [("priv.q", "a")]
    engine.publish("priv.q", 3, owner="a")
    engine.mark_ready("a")
    assert messages(cycle(engine)["a"]) == [2, 3]


def test_private_explicit_seq_makes_a_retry_idempotent():
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "priv.q")
    engine.publish("priv.q", "x", owner="a", seq=0)
    with pytest.raises(StaleSeq):
        engine.publish("priv.q", "x", owner="a", seq=0)


def test_direct_entries_precede_topic_entries_and_the_budget_caps_the_batch():
    engine = Engine(EngineConfig(cycle_budget_bytes=200), instance_id="t")
    engine.create_topic("t", TopicConfig(batch_depth=100, capacity=100))
    engine.connect("a")
    engine.subscribe("a", "t")
    cycle(engine)
    for _ in range(50):
        engine.publish("t", "x" * 20)
    engine.send_direct("a", encode_reply(1, "r"))
    batch = engine.run_cycle()[0]
    got = decode(batch)
    assert got[0]["type"] == "reply"
    assert 1 < len(got) < 51
    assert batch.size - len(batch.entries[-1]) < 200  # stops at the budget, overshoot at most one entry
    engine.write_done("a")
    assert messages(cycle(engine)["a"])[0] == messages(got)[-1] + 1


def test_at_least_one_entry_goes_even_when_larger_than_the_budget():
    engine = Engine(EngineConfig(cycle_budget_bytes=10), instance_id="t")
    engine.create_topic("t")
    engine.connect("a")
    engine.subscribe("a", "t")
    got = cycle(engine)["a"]
    assert len(got) == 1


def test_one_message_per_topic_per_cycle_and_pending_topics_go_first():
    engine = make_engine()
    engine.connect("a")
    for t in ("hot", "cold", "late"):
        engine.subscribe("a", t)
    cycle(engine)
    for i in range(5):
        engine.publish("hot", i)
    engine.publish("cold", 0)
    got = cycle(engine, complete=False)["a"]
    assert [(e["topic"], e["seq"]) for e in got] == [("hot", 0), ("cold", 0)]
    engine.publish("late", 0)  # became active after "hot", which still holds data
    engine.write_done("a")
    got = cycle(engine)["a"]
    assert [(e["topic"], e["seq"]) for e in got] == [("hot", 1), ("late", 0)]


def test_handles_not_reached_are_served_first_next_cycle():
    engine = Engine(EngineConfig(cycle_budget_bytes=1), instance_id="t")
    engine.connect("a")
    for t in ("x", "y", "z"):
        engine.create_topic(t)
        engine.subscribe("a", t)
    while cycle(engine):
        pass
    for t in ("x", "y", "z"):
        engine.publish(t, 0)
        engine.publish(t, 1)
    order = [cycle(engine)["a"][0]["topic"] for _ in range(6)]
    assert order == ["x", "y", "z", "x", "y", "z"]


def test_coalescing_a_thousand_publishes_leave_one_handle_and_one_client_entry():
    engine = make_engine(capacity=2000)
    engine.connect("a")
    engine.subscribe("a", "t")
    cycle(engine)
    for i in range(1000):
        engine.publish("t", i)
    client = engine.client("a")
    assert len(client.active) == 1
    assert list(engine._active) == [client]


def test_a_not_ready_client_receives_nothing_and_costs_nothing():
    engine = make_engine()
    engine.connect("a", ready=False)
    engine.subscribe("a", "t")
    engine.publish("t", 1)
    assert engine.run_cycle() == []
    assert not engine.has_work
    engine.mark_ready("a")
    assert messages(cycle(engine)["a"]) == [0]


def test_a_writing_client_gets_nothing_until_its_write_is_done():
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "t")
    engine.run_cycle()
    engine.publish("t", 1)
    assert engine.run_cycle() == []
    engine.write_done("a")
    assert len(engine.run_cycle()) == 1


def test_out_of_order_within_the_window_is_delivered_in_order():
    engine = make_engine(reorder_window=8)
    engine.connect("a")
    engine.subscribe("a", "t")
    cycle(engine)
    for seq in (2, 0, 3, 1):
        engine.publish("t", seq, seq=seq)
    with pytest.raises(StaleSeq):
        engine.publish("t", "again", seq=1)
    engine.publish("t", 5, seq=5)
    with pytest.raises(DuplicateSeq):
        engine.publish("t", 5, seq=5)
    seen = []
    while got := cycle(engine):
        seen += messages(got["a"])
    assert seen == [0, 1, 2, 3]


def test_a_hole_past_the_window_or_timeout_becomes_a_loss_notice():
    engine = make_engine(reorder_window=4, hole_timeout=1.0)
    engine.connect("a")
    engine.subscribe("a", "t")
    cycle(engine)
    engine.publish("t", 1, seq=1, now=0.0)
    engine.publish("t", 4, seq=4, now=0.0)  # 4 >= hole 0 + window 4: seq 0 is given up
    got = []
    while batch := cycle(engine):
        got += batch["a"]
    assert got[0] == {"type": "loss", "topic": "t", "from": 0, "to": 1, "reason": "skipped"}
    assert messages(got) == [1]
    with pytest.raises(SkippedSeq):  # too late: told apart from a retry of a seq that landed
        engine.publish("t", 0, seq=0)
    with pytest.raises(StaleSeq):
        engine.publish("t", 1, seq=1)
    assert engine.tick(0.5) == 0
    assert engine.tick(1.5) == 1  # holes 2 and 3 timed out
    got = []
    while batch := cycle(engine):
        got += batch["a"]
    assert got[0] == {"type": "loss", "topic": "t", "from": 2, "to": 4, "reason": "skipped"}
    assert messages(got) == [4]


def test_reserve_hands_out_half_open_ranges():
    engine = make_engine()
    assert engine.reserve("t", 3) == (0, 3)
    assert engine.reserve("t", 2) == (3, 5)
    engine.publish("t", "auto")
    assert engine.topic("t").info()["pending"] == 1  # got seq 5, waits for 0..4


def test_disconnect_leaves_no_trace():
    engine = make_engine()
    engine.connect("a")
    for t in ("x", "y", "priv.q", "snap.s"):
        engine.subscribe("a", t)
    engine.publish("x", 1)
    engine.disconnect("a")
    for t in ("x", "y", "priv.q", "snap.s"):
        topic = engine.topic(t)
        assert not topic.subs and not topic.idle
    assert not engine.topic("priv.q").queues
    assert not engine.has_work


def test_unknown_topic_without_rule_and_direct_queue_bound():
    engine = Engine(EngineConfig(direct_queue_max=2), instance_id="t")
    engine.connect("a")
    with pytest.raises(UnknownTopic):
        engine.subscribe("a", "nope")
    engine.send_direct("a", b"{}")
    engine.send_direct("a", b"{}")
    with pytest.raises(DirectQueueFull):
        engine.send_direct("a", b"{}")


def test_delete_topic_notifies_subscribers():
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "t")
    cycle(engine)
    assert engine.delete_topic("t") == 1
    assert cycle(engine)["a"] == [{"type": "closed", "topic": "t", "reason": "deleted"}]
    assert engine.client("a").subs == {}


def test_publish_cost_touches_only_idle_subscribers():
    engine = make_engine(capacity=8)
    for c in range(100):
        engine.connect(c)
        engine.subscribe(c, "t")
    engine.publish("t", 0)
    topic = engine.topic("t")
    assert len(topic.idle) == 0  # all 100 were woken once
    engine.publish("t", 1)  # nobody idle: nothing to walk
    assert all(len(engine.client(c).active) == 1 for c in range(100))
