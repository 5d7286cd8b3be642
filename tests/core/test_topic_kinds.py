"""Every topic kind answers the engine's calls itself (core/topics.py): the engine never asks which kind a
topic is. These tests pin down, through the engine, each behaviour that used to be a branch on the kind, so
that one lost in a kind's hook shows up here; the last one keeps such branches out of engine.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from core import Engine, QueueFull, RequestError, TopicKind
from core.errors import CoreUsageError
from core.topics import Topic
from tests.core.core_helpers import cycle, make_engine, messages

pytestmark = pytest.mark.unit

#: a topic name per kind, as make_engine's rules create them
NAMES = {TopicKind.RING: "t", TopicKind.SNAPSHOT: "snap.t", TopicKind.PRIVATE: "priv.t"}


def _drain(engine: Engine) -> None:
    while cycle(engine):
        pass


@pytest.mark.parametrize("kind", list(TopicKind))
def test_every_kind_takes_the_same_publish_call_and_wakes_only_who_reads_it(kind: TopicKind) -> None:
    engine = make_engine()
    name = NAMES[kind]
    for c in ("a", "b"):
        engine.connect(c)
        engine.subscribe(c, name)
    _drain(engine)
    assert engine.resolve(name).kind == kind.value
    # One signature for every kind: `owner` picks the private queue; shared kinds ignore it.
    engine.publish(name, "x", owner="a")
    woken = {client.id for client in engine._active}
    got = cycle(engine)
    if kind is TopicKind.PRIVATE:
        assert woken == {"a"} and not engine.client("b").active  # bob's parked handle stays parked
        assert messages(got["a"]) == [0] and "b" not in got
    else:
        assert woken == {"a", "b"}
        assert messages(got["a"]) == messages(got["b"]) == [0]
    assert not engine._holey  # in-order publishes leave nothing for `tick`
    assert engine.tick(now=100.0) == 0


def test_parked_private_handles_wait_in_no_idle_set() -> None:
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "priv.t")
    _drain(engine)
    topic = engine.topic("priv.t")
    sub = engine.client("a").subs["priv.t"]
    assert not sub.active and not topic.idle
    engine.publish("priv.t", 0, owner="a")
    assert sub.active and not topic.idle
    engine.publish("priv.t", 1, owner="a")  # already active: nothing more to wake
    assert list(engine.client("a").active) == [sub]
    assert messages(cycle(engine)["a"]) == [0]


def test_a_shared_topic_publish_naming_an_owner_reaches_every_subscriber() -> None:
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "t")
    _drain(engine)
    engine.publish("t", "from ingest", owner="somebody-else")  # an ingest record's `client` on a ring topic
    assert messages(cycle(engine)["a"]) == [0]


def test_a_private_publish_needs_an_owner_holding_a_queue() -> None:
    engine = make_engine()
    with pytest.raises(RequestError) as info:
        engine.publish("priv.t", "x")
    assert info.value.code == "no_target"
    with pytest.raises(RequestError) as info:
        engine.publish("priv.t", "x", owner="nobody")
    assert info.value.code == "not_subscribed"


@pytest.mark.parametrize("kind", [TopicKind.SNAPSHOT, TopicKind.PRIVATE])
def test_reserve_is_refused_on_kinds_without_reserved_seqs(kind: TopicKind) -> None:
    engine = make_engine()
    with pytest.raises(CoreUsageError):
        engine.reserve(NAMES[kind], 2)
    assert engine.reserve("t", 2) == (0, 2)


@pytest.mark.parametrize("kind", [TopicKind.RING, TopicKind.SNAPSHOT])
def test_commit_and_rollback_leave_shared_handles_alone(kind: TopicKind) -> None:
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", NAMES[kind])
    _drain(engine)
    engine.publish(NAMES[kind], 0)
    assert engine.run_cycle()
    assert engine.client("a").peeked_subs == []  # nothing handed out needs a commit
    engine.rollback("a")  # a shared cursor is not rewound: nothing is handed out again
    engine.mark_ready("a")
    assert engine.run_cycle() == []
    engine.commit("a")
    assert engine.take_space_freed() == []


@pytest.mark.parametrize("leave", ["unsubscribe", "disconnect", "delete_topic"])
def test_a_publisher_waiting_on_a_queue_that_goes_is_told(leave: str) -> None:
    engine = make_engine(max_count=1)
    engine.connect("a")
    engine.subscribe("a", "priv.t")
    engine.publish("priv.t", 0, owner="a")
    with pytest.raises(QueueFull):
        engine.publish("priv.t", 1, owner="a")
    assert engine.take_space_freed() == []
    if leave == "unsubscribe":
        engine.unsubscribe("a", "priv.t")
    elif leave == "disconnect":
        engine.disconnect("a")
    else:
        engine.delete_topic("priv.t")
    assert engine.take_space_freed() == [("priv.t", "a")]  # it retries and gets not_subscribed


def test_no_waiting_publisher_no_space_freed_report() -> None:
    engine = make_engine()
    engine.connect("a")
    for name in NAMES.values():
        engine.subscribe("a", name)
    engine.publish("priv.t", 0, owner="a")
    engine.disconnect("a")
    assert engine.take_space_freed() == []


def test_the_owner_may_change_while_only_shared_topics_are_held() -> None:
    engine = make_engine()
    engine.connect("a")
    engine.subscribe("a", "t")
    engine.subscribe("a", "snap.t")
    engine.set_owner("a", "alice")
    assert engine.client("a").owner == "alice"
    engine.subscribe("a", "priv.t")
    with pytest.raises(CoreUsageError):
        engine.set_owner("a", "bob")


@pytest.mark.parametrize("kind", [TopicKind.RING, TopicKind.SNAPSHOT])
def test_a_second_connection_of_the_owner_takes_nothing_over_on_shared_kinds(kind: TopicKind) -> None:
    engine = make_engine()
    for c in ("tab1", "tab2"):
        engine.connect(c, owner="alice")
        engine.subscribe(c, NAMES[kind])
    got = cycle(engine)
    assert all(e["type"] != "closed" for entries in got.values() for e in entries)
    assert set(engine.client("tab1").subs) == {NAMES[kind]}


def test_a_parked_private_handle_taken_over_leaves_no_trace_in_the_topic() -> None:
    engine = make_engine()
    engine.connect("tab1", owner="alice")
    engine.subscribe("tab1", "priv.t")
    _drain(engine)
    old = engine.client("tab1").subs["priv.t"]
    engine.connect("tab2", owner="alice")
    engine.subscribe("tab2", "priv.t")
    topic = engine.topic("priv.t")
    assert old not in topic.subs and old not in topic.idle and old.queue is None
    assert list(topic.queues.values()) == [engine.client("tab2").subs["priv.t"]]  # type: ignore[attr-defined]  # a private topic


def test_only_topics_with_out_of_order_arrivals_are_ticked() -> None:
    engine = make_engine(reorder_window=8, hole_timeout=1.0)
    engine.publish("t", 1, seq=1, now=0.0)
    engine.publish("snap.t", 0, seq=5)
    assert list(engine._holey) == [engine.topic("t")]
    assert engine.tick(now=2.0) == 1
    assert not engine._holey


# -- engine.py stays kind-agnostic --------------------------------------------------------------------------

ENGINE = Path(__file__).resolve().parents[2] / "core" / "engine.py"
KIND_CLASSES = {cls.__name__ for cls in Topic.__subclasses__()}
#: Subscription fields only one kind uses: the engine goes through the topic's hooks instead
KIND_FIELDS = {"queue", "queues", "queued_bytes", "publish_to"}


def test_engine_names_the_kinds_only_in_its_kind_to_class_table() -> None:
    tree = ast.parse(ENGINE.read_text(), filename=str(ENGINE))
    assert KIND_CLASSES == {"RingTopic", "SnapshotTopic", "PrivateTopic"}
    table = next(
        node for node in tree.body if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_TOPIC_CLASSES"
    )
    in_table = {id(node) for node in ast.walk(table)}
    stray = [
        (node.lineno, node.id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id in KIND_CLASSES and id(node) not in in_table
    ]
    assert stray == []
    calls = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("isinstance", "type")
    ]
    assert calls == [], "engine.py asks what a value is: declare the behaviour on the topic kinds"
    fields = [(node.lineno, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in KIND_FIELDS]
    assert fields == []
