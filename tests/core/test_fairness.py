"""The hierarchical cycle (core/fairness.py): tenants by start-time fair queuing tags, users by deficit round
robin, costs in bytes plus a frame cost. Saturated models of the cycle, run on the real engine: every client
backlogged on its own topic, each cycle's batches written at once (the scheduler's `writes_done`)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import Engine, EngineConfig, TopicConfig, TopicRule
from core.fairness import FairShare

pytestmark = pytest.mark.unit

RULES = (TopicRule("t*", TopicConfig(capacity=8)),)
PAYLOAD = {"v": "x" * 80}


def fair_engine(**fair_kwargs: int) -> Engine:
    engine = Engine(EngineConfig(rules=RULES), instance_id="f")
    engine.enable_fairness(FairShare(**fair_kwargs))
    return engine


def saturate(engine: Engine, topics: list[str], cycles: int) -> Counter[str]:
    """Run `cycles` cycles, one publish on every topic before each: frames served per client."""
    frames: Counter[str] = Counter()
    for _ in range(cycles):
        for name in topics:
            engine.publish(name, PAYLOAD)
        batches = engine.run_cycle()
        for batch in batches:
            frames[str(batch.client_id)] += 1
        engine.writes_done([batch.client_id for batch in batches])
    return frames


def two_tenants(a: int, b: int, weights: tuple[float, float] = (1.0, 1.0)) -> tuple[Engine, list[str]]:
    engine = fair_engine(cycle_target_cost=200_000)
    fair = engine.fair
    assert fair is not None
    fair.set_weight("A", weights[0])
    fair.set_weight("B", weights[1])
    topics = []
    for tenant, count in (("A", a), ("B", b)):
        for i in range(count):
            client, topic = f"{tenant}{i}", f"t.{tenant}{i}"
            engine.connect(client, tenant=tenant)
            engine.subscribe(client, topic)
            topics.append(topic)
    return engine, topics


def cost_shares(engine: Engine) -> dict[str, float]:
    fair = engine.fair
    assert fair is not None
    total = sum(t.cost for t in fair.tenants.values())
    return {name: t.cost / total for name, t in fair.tenants.items()}


@pytest.mark.parametrize(("weights", "share_a"), [((1.0, 1.0), 0.5), ((3.0, 1.0), 0.75)])
def test_nine_times_the_connections_take_the_weighted_share_not_nine_tenths(weights, share_a):
    engine, topics = two_tenants(90, 10, weights)
    saturate(engine, topics, 20)  # the tags settle
    fair = engine.fair
    assert fair is not None
    for tenant in fair.tenants.values():
        tenant.cost = 0
    saturate(engine, topics, 200)
    shares = cost_shares(engine)
    assert abs(shares["A"] - share_a) <= 0.05 * share_a, shares
    # the flat cycle on the same load: a tenant's share is its share of connections
    flat = Engine(EngineConfig(rules=RULES), instance_id="f")
    for name in topics:
        client = name.removeprefix("t.")
        flat.connect(client)
        flat.subscribe(client, name)
    frames = saturate(flat, topics, 50)
    flat_a = sum(n for client, n in frames.items() if client.startswith("A")) / sum(frames.values())
    assert flat_a == pytest.approx(0.9, abs=0.01)


def test_a_tenant_under_its_share_gets_all_it_asks_for():
    engine, topics = two_tenants(90, 10)
    b_topics = [name for name in topics if name.startswith("t.B")]
    a_topics = [name for name in topics if name.startswith("t.A")]
    served: Counter[str] = Counter()
    for i in range(200):
        for name in a_topics:
            engine.publish(name, PAYLOAD)
        if i % 4 == 0:  # B asks a quarter of what it could get
            for name in b_topics:
                engine.publish(name, PAYLOAD)
        batches = engine.run_cycle()
        served.update(b.client_id[0] for b in batches)
        engine.writes_done([b.client_id for b in batches])
    for _ in range(3):  # what B was sent last is written
        batches = engine.run_cycle()
        served.update(b.client_id[0] for b in batches)
        engine.writes_done([b.client_id for b in batches])
    assert served["B"] == 10 * 50  # every publish of B's, none lost
    assert served["A"] > 4 * served["B"]  # and A takes the rest (work conserving)


def test_a_user_with_twenty_tabs_counts_as_one_user_beside_others():
    engine = fair_engine()
    engine.create_topic("t.one", TopicConfig(capacity=8))
    for tab in range(20):
        engine.connect(f"tab{tab}", tenant="T", user="many")
        engine.subscribe(f"tab{tab}", "t.one")
    for u in range(19):
        engine.connect(f"solo{u}", tenant="T", user=f"u{u}")
        engine.subscribe(f"solo{u}", "t.one")
    # saturated: more cost asked each cycle than the cycle's target (the node is the bottleneck)
    fair = engine.fair
    assert fair is not None
    fair.cycle_target_cost = 10 * (fair.frame_cost + 200)
    frames = Counter()
    for _ in range(400):
        engine.publish("t.one", PAYLOAD)
        engine.publish("t.one", PAYLOAD)
        batches = engine.run_cycle()
        frames.update("many" if b.client_id.startswith("tab") else b.client_id for b in batches)
        engine.writes_done([b.client_id for b in batches])
    total = sum(frames.values())
    share = frames["many"] / total
    assert abs(share - 1 / 20) <= 0.05 * (1 / 20) + 0.005, (share, frames.most_common(3))


def test_a_lone_users_twenty_tabs_all_go_out_in_one_cycle():
    engine = fair_engine()
    engine.create_topic("t.one", TopicConfig(capacity=8))
    for tab in range(20):
        engine.connect(f"tab{tab}", tenant="T", user="many")
        engine.subscribe(f"tab{tab}", "t.one")
    for _ in range(5):
        engine.publish("t.one", PAYLOAD)
        batches = engine.run_cycle()
        assert len(batches) == 20  # nobody else waits: the passed-over tabs go in the second pass
        engine.writes_done([b.client_id for b in batches])


def test_idle_tenants_are_never_visited_and_a_disconnect_frees_its_user():
    engine = fair_engine()
    fair = engine.fair
    assert fair is not None
    for t in range(1000):
        engine.connect(f"idle{t}", tenant=f"idle-tenant-{t}")
    engine.connect("busy", tenant="B", user="u")
    engine.subscribe("busy", "t.busy")
    engine.publish("t.busy", PAYLOAD)
    batches = engine.run_cycle()
    assert [b.client_id for b in batches] == ["busy"] and list(fair.active) == []
    engine.writes_done(["busy"])
    engine.publish("t.busy", PAYLOAD)  # in B's deque when it disconnects
    engine.run_cycle()
    engine.publish("t.busy", PAYLOAD)
    engine.disconnect("busy")
    assert "u" not in fair.tenants["B"].users and fair.tenants["B"].clients == 0
    assert engine.run_cycle() == []


def test_enable_fairness_after_a_client_connected_is_refused():
    engine = Engine(EngineConfig(rules=RULES), instance_id="f")
    engine.connect("c")
    with pytest.raises(Exception, match="before the first client"):
        engine.enable_fairness(FairShare())
    with pytest.raises(ValueError):
        FairShare().set_weight("A", 0)


# -- one tenant, every client its own user, a quantum nothing exceeds: the flat cycle, batch for batch ------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("connect"), st.integers(0, 5)),
        st.tuples(st.just("disconnect"), st.integers(0, 5)),
        st.tuples(st.just("subscribe"), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("publish"), st.integers(0, 3), st.integers(1, 400)),
        st.tuples(st.just("direct"), st.integers(0, 5)),
        st.tuples(st.just("idle"), st.integers(0, 5)),
        st.tuples(st.just("ready"), st.integers(0, 5)),
        st.tuples(st.just("cycle"), st.booleans()),
    ),
    max_size=80,
)


def apply(engine: Engine, op: tuple, log: list) -> None:
    kind = op[0]
    client = f"c{op[1]}"
    try:
        if kind == "connect":
            engine.connect(client)
        elif kind == "disconnect":
            engine.disconnect(client)
        elif kind == "subscribe":
            engine.subscribe(client, f"t{op[2]}")
        elif kind == "publish":
            engine.publish(f"t{op[1]}", {"v": "y" * op[2]})
        elif kind == "direct":
            engine.send_direct(client, b'{"type":"reply"}')
        elif kind == "idle":
            engine.mark_idle(client)
        elif kind == "ready":
            engine.mark_ready(client)
        else:
            batches = engine.run_cycle()
            log.append([(b.client_id, b.entries, b.size, b.more) for b in batches])
            if op[1]:
                engine.writes_done([b.client_id for b in batches])
    except Exception as exc:  # the same refusal on both sides
        log.append(type(exc).__name__)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_fairness_on_with_nothing_to_share_gives_the_flat_cycles_batches(ops):
    flat = Engine(EngineConfig(rules=RULES, cycle_budget_bytes=1000), instance_id="x")
    fair = Engine(EngineConfig(rules=RULES, cycle_budget_bytes=1000), instance_id="x")
    fair.enable_fairness(FairShare(quantum=10**9))
    flat_log: list = []
    fair_log: list = []
    for op in ops:
        apply(flat, op, flat_log)
        apply(fair, op, fair_log)
    assert fair_log == flat_log


TENANT_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("connect"), st.integers(0, 7)),
        st.tuples(st.just("disconnect"), st.integers(0, 7)),
        st.tuples(st.just("subscribe"), st.integers(0, 7), st.integers(0, 3)),
        st.tuples(st.just("publish"), st.integers(0, 3), st.integers(1, 3000)),
        st.tuples(st.just("direct"), st.integers(0, 7)),
        st.tuples(st.just("idle"), st.integers(0, 7)),
        st.tuples(st.just("ready"), st.integers(0, 7)),
        st.tuples(st.just("cycle"), st.booleans()),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(TENANT_OPS, st.integers(1, 3))
def test_with_tenants_and_users_nobody_starves_and_no_client_is_in_line_twice(ops, weight_b):
    engine = Engine(EngineConfig(rules=RULES, cycle_budget_bytes=2000), instance_id="x")
    share = FairShare(frame_cost=500, cycle_target_cost=3000)
    engine.enable_fairness(share)
    share.set_weight("B", weight_b)
    for op in ops:
        client = f"c{op[1]}"
        try:
            if op[0] == "connect":  # c0-c3 in A, c4-c7 in B; two clients per user
                engine.connect(client, tenant="A" if op[1] < 4 else "B", user=f"u{op[1] // 2}")
            else:
                apply(engine, op, [])
        except Exception:
            pass
        for tenant in share.tenants.values():
            lined = [c.id for c in tenant.ready]
            assert len(lined) == len(set(lined)), lined
            assert all(c.in_line for c in tenant.ready)
    # every client ready again and every write done: the cycles drain everything, whatever the shares
    for client in engine.clients():
        engine.mark_ready(client.id)
    for _ in range(200):
        batches = engine.run_cycle()
        engine.writes_done([b.client_id for b in batches])
        if not engine.has_work:
            break
    assert not engine.has_work
    assert all(not (c.direct or c.active) for c in engine.clients())
    assert sum(t.clients for t in share.tenants.values()) == len(engine.clients())
    assert sum(len(t.users) for t in share.tenants.values()) == len({c.user.key for c in engine.clients() if c.user})


def test_a_client_that_went_idle_in_line_is_served_once_it_is_ready_again():
    engine = fair_engine()
    engine.create_topic("t.one", TopicConfig(capacity=8))
    for tab in range(3):
        engine.connect(f"tab{tab}", tenant="T", user="many")
        engine.subscribe(f"tab{tab}", "t.one")
    engine.connect("solo", tenant="T", user="solo")
    engine.subscribe("solo", "t.one")
    for _ in range(4):
        engine.publish("t.one", PAYLOAD)
    served = [b.client_id for b in engine.run_cycle()]
    # a quantum is about one small frame and a bit: tab0 leaves `many` in credit, tab1 in debt, tab2 waits
    assert sorted(served) == ["solo", "tab0", "tab1"]
    engine.writes_done(served)
    engine.mark_idle("tab2")  # in line when it stopped being ready (e.g. a long poll returned)
    seen: Counter[str] = Counter()
    for _ in range(6):
        engine.publish("t.one", PAYLOAD)
        batches = engine.run_cycle()
        seen.update(b.client_id for b in batches)
        engine.writes_done([b.client_id for b in batches])
    assert seen["tab2"] == 0 and seen["solo"] == 6
    engine.mark_ready("tab2")
    for _ in range(3):
        batches = engine.run_cycle()
        seen.update(b.client_id for b in batches)
        engine.writes_done([b.client_id for b in batches])
    assert seen["tab2"] >= 1
