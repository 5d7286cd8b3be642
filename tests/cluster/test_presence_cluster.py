"""Presence across nodes on one real Redis (docs/integration.md, "Presence", "Cluster"): members seen from
either node, join/leave entries across nodes, and a node killed with -9 whose members leave every answer
within the heartbeat's TTL (gateway/broker/presence_store.py: 3 s), with one `leave` entry each to every
other node's subscribers within the TTL and a sweep period (4 s)."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from gateway.broker.presence_store import ALIVE_TTL_MS, HEARTBEAT_S, MEMBER_TTL_MS
from tests.cluster.cluster_helpers import collect, send, subscribe
from tests.gateway.gw_helpers import recv_entries, wait_for

RULE = {"rule": {"presence": True, "join_leave": True}}


@pytest.fixture(scope="module")
def survivors(module_nodes):
    """Nodes A and C, which outlive every test (each test kills or stalls a B of its own, in a room of its own)."""
    return module_nodes.start("a", **RULE), module_nodes.start("c", **RULE)


@pytest.fixture
def nodes_b(module_nodes):
    """`nodes_b()`: this test's node B on the module's Redis (killed or stalled by the test; killed after it)."""
    started = []

    def start():
        started.append(module_nodes.start(f"b{len(module_nodes.nodes)}", **RULE))
        return started[-1]

    yield start
    for node in started:
        node.kill_group()


def ask(ws, op: str, topic: str, request_id: str) -> dict:
    send(ws, op=op, topic=topic, id=request_id)
    got = collect(ws, lambda g: any(e.get("id") == request_id for e in g))
    return next(e for e in got if e.get("id") == request_id)["result"]


def client_id(ws) -> str:
    send(ws, op="rpc", method="whoami", id="who")
    got = collect(ws, lambda g: any(e.get("id") == "who" for e in g))
    return next(e for e in got if e.get("id") == "who")["result"]["client_id"]


def test_members_join_leave_across_nodes_then_a_killed_nodes_members_leave_and_its_unread_keys_wait_for_a_read(
    nodes_b, survivors, module_redis
):
    """Members and join/leave across nodes in room1; then B is killed with -9 (one kill, one TTL's wait for
    two checks): its member in room1 leaves A's answers within the heartbeat's TTL; its member in room4, which
    no other node holds and nobody reads, keeps its keys (each with the TTL its holder refreshes, so keys
    nobody reads go too) past B's heartbeat, until a read on A (no holder alive) deletes them."""
    (a, _), b = survivors, nodes_b()
    store = redis.Redis(port=module_redis.port)
    with a.ws() as on_a, b.ws() as on_b, b.ws() as on_b2, b.ws() as on_b4:
        a_id, b_id, b2_id = client_id(on_a), client_id(on_b), client_id(on_b2)
        subscribe(on_a, "room1")
        subscribe(on_b, "room1")  # A is told, through Redis
        got = collect(on_a, lambda g: any(e["type"] == "join" for e in g))
        assert [e for e in got if e["type"] == "join"] == [{"type": "join", "topic": "room1", "user": None, "client": b_id}]
        result = ask(on_a, "presence", "room1", "p")
        assert (result["clients"], result["users"]) == (2, 2)
        assert sorted(m["client"] for m in result["members"]) == sorted([a_id, b_id])
        assert a.api("/topics/room1/presence")["clients"] == b.api("/topics/room1/presence")["clients"] == 2
        send(on_b, op="unsubscribe", topic="room1")
        got = collect(on_a, lambda g: any(e["type"] == "leave" for e in g))
        assert [e["client"] for e in got if e["type"] == "leave"] == [b_id]
        assert ask(on_a, "presence_stats", "room1", "s") == {"topic": "room1", "clients": 1, "users": 1}
        # a member on B, then B is killed: it leaves every answer within the heartbeat's TTL
        subscribe(on_b2, "room1")
        wait_for(lambda: a.api("/topics/room1/presence")["clients"] == 2, "B2 a member")
        subscribe(on_b4, "room4")  # room4: a member on B alone
        wait_for(lambda: a.api("/topics/room4/presence")["clients"] == 1, "B's member in room4")
        member_keys = wait_for(lambda: [k for k in store.scan_iter("*{room4}:pm:*")] or None, "B's member keys")
        owner_keys = list(store.scan_iter("*{room4}:pu:*"))
        node_sets = list(store.scan_iter("*{room4}:pn"))
        for key in member_keys + owner_keys + node_sets:
            assert 0 < store.pttl(key) <= MEMBER_TTL_MS, key
        b_node = member_keys[0].decode().rsplit(":pm:", 1)[1]
        heartbeat = [k for k in store.scan_iter("*:palive:*") if k.decode().endswith(":" + b_node)]
        assert len(heartbeat) == 1
        b.kill9()
        killed = time.monotonic()
        wait_for(lambda: a.api("/topics/room1/presence")["clients"] == 1, "B's members gone", timeout=10)
        assert time.monotonic() - killed < ALIVE_TTL_MS / 1000 + 1.5
        assert a.api("/topics/room1/presence")["members"] == [{"user": None, "client": a_id, "info": None}]
        assert b2_id
        # room4: B's keys outlive its heartbeat while nobody reads them; a read deletes them
        wait_for(lambda: not store.exists(heartbeat[0]), "B's heartbeat gone", timeout=10)
        assert store.exists(*member_keys) == len(member_keys)  # nobody has read since
        assert a.api("/topics/room4/presence")["clients"] == 0
        assert store.exists(*member_keys, *owner_keys, *node_sets) == 0


def drain(ws, seconds: float) -> list[dict]:
    """Every entry that comes within `seconds`."""
    got: list[dict] = []
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            got += recv_entries(ws, remaining)
        except TimeoutError:
            break
    return got


def test_a_killed_nodes_members_leave_with_one_leave_entry_each_on_every_other_node(nodes_b, survivors, module_redis):
    """B holds two members, then is killed with -9: A's subscriber (there before B's members, so told of
    their joins) and C's (subscribed after them: C read them from Redis) each get one `leave` per member of
    B within the bound (heartbeat TTL + sweep period), and no more; A and C both sweep, one of them deletes
    B's keys."""
    (a, c), b = survivors, nodes_b()
    with a.ws() as on_a, b.ws() as on_b, b.ws() as on_b2, c.ws() as on_c:
        b_ids = {client_id(on_b), client_id(on_b2)}
        c_id = client_id(on_c)
        subscribe(on_a, "room2")
        subscribe(on_b, "room2")
        subscribe(on_b2, "room2")
        collect(on_a, lambda g: {e["client"] for e in g if e["type"] == "join"} >= b_ids)
        subscribe(on_c, "room2")  # C serves the topic only now: B's members are read from Redis
        collect(on_a, lambda g: any(e["type"] == "join" and e["client"] == c_id for e in g))
        time.sleep(2 * HEARTBEAT_S)  # C's next sweep has read the topic
        b.kill9()
        killed = time.monotonic()
        bound = ALIVE_TTL_MS / 1000 + HEARTBEAT_S + 1.0  # + a margin for two busy cores
        seen = {}
        for name, ws in (("a", on_a), ("c", on_c)):
            seen[name] = collect(ws, lambda g: {e["client"] for e in g if e["type"] == "leave"} >= b_ids, timeout=10)
            assert time.monotonic() - killed < bound, (name, time.monotonic() - killed)
        time.sleep(2 * HEARTBEAT_S)  # more sweeps on both nodes: no second leave
        for name, ws in (("a", on_a), ("c", on_c)):
            entries = seen[name] + drain(ws, 0.3)
            assert sorted(e["client"] for e in entries if e["type"] == "leave") == sorted(b_ids), (name, entries)
            assert all(e["type"] in ("leave", "join") for e in entries), entries
        # B's keys are gone (deleted by a sweep: no `presence` read was made), A's and C's are left
        client = redis.Redis.from_url(module_redis.url)
        try:
            assert len(client.keys("*{room2}:pm:*")) == len(client.keys("*{room2}:pu:*")) == 2
            assert client.scard(next(iter(client.keys("*{room2}:pn")))) == 2
        finally:
            client.close()
        assert c.api("/topics/room2/presence")["clients"] == a.api("/topics/room2/presence")["clients"] == 2


def test_a_node_stalled_past_the_ttl_is_swept_then_announces_its_members_again(nodes_b, survivors):
    """B stops (SIGSTOP) for longer than the heartbeat's TTL: A's subscriber gets a `leave` for B's member;
    once B runs again it finds its heartbeat key gone, writes its members again and announces them: one
    `join`, and the member is listed again."""
    (a, _), b = survivors, nodes_b()
    with a.ws() as on_a, b.ws() as on_b:
        b_id = client_id(on_b)
        subscribe(on_a, "room3")
        subscribe(on_b, "room3")
        collect(on_a, lambda g: any(e["type"] == "join" for e in g))
        assert b.proc is not None
        b.proc.send_signal(signal.SIGSTOP)
        try:
            got = collect(on_a, lambda g: any(e["type"] == "leave" for e in g), timeout=10)
            assert [e["client"] for e in got if e["type"] == "leave"] == [b_id]
            assert a.api("/topics/room3/presence")["clients"] == 1
        finally:
            b.proc.send_signal(signal.SIGCONT)
        got = collect(on_a, lambda g: any(e["type"] == "join" for e in g), timeout=10)
        got += drain(on_a, 2 * HEARTBEAT_S)
        assert [(e["type"], e["client"]) for e in got] == [("join", b_id)]
        assert sorted(m["client"] for m in a.api("/topics/room3/presence")["members"]) == sorted([b_id, client_id(on_a)])
