"""Fossil deltas on `/ws` (docs/protocol.md, "Deltas"), with a real gateway and real WebSocket clients: the
entries a delta subscriber gets, what rebuilds from them (centrifuge-python's decoder as the independent
check), the first message after a subscribe or a resume sent whole, topics without the rule, and the Python
client's subscriptions (every message intact, a broken base mended by resubscribing)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from centrifuge.fossil import apply_delta  # type: ignore[import-untyped]

import fanout_client
from fanout_client import Message
from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, ws_connect

pytestmark = pytest.mark.timeout(60)

RULES = {
    "rules": [
        {"pattern": "book.*", "kind": "ring", "anonymous": True, "delta": "fossil", "capacity": 16},
        {"pattern": "state.*", "kind": "snapshot", "anonymous": True, "delta": "fossil"},
        {"pattern": "plain.*", "kind": "ring", "anonymous": True},
    ]
}


@pytest.fixture(scope="module")
def gw() -> Iterator[Any]:
    """One gateway of RULES for the tests that need no other setting: each on topics of its own."""
    with run_gateway(topics=copy.deepcopy(RULES)) as handle:
        yield handle


def book(step: int) -> dict[str, Any]:
    """An order book of 20 levels a side; each step changes three levels."""
    levels = {"bids": [[10000 - i, 100 + i] for i in range(20)], "asks": [[10001 + i, 200 + i] for i in range(20)]}
    for k in range(step):
        levels["bids" if k % 2 else "asks"][(k * 7) % 20][1] += k + 1
    return levels


def publish(gw: Any, topic: str, data: Any) -> int:
    reply = web.post(f"{gw.http_url}/api/topics/{topic}/publish", json={"data": data}, headers=auth(gw))
    assert reply.status_code == 200, reply.text
    seqs: list[int] = reply.json()["seqs"]
    return seqs[0]


def messages(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if e["type"] == "msg"]


def rebuild(entries: list[dict[str, Any]]) -> list[Any]:
    """The data of each message entry, rebuilt as a delta subscriber must, with centrifuge's decoder."""
    base = b""
    out = []
    for entry in messages(entries):
        assert isinstance(entry["data"], str) and isinstance(entry["delta"], bool)
        text = entry["data"].encode()
        base = apply_delta(base, text) if entry["delta"] else text
        out.append(orjson.loads(base))
    return out


def test_ring_deltas_rebuild_what_was_published_and_plain_subscribers_are_unchanged(gw) -> None:
    with ws_connect(gw) as ws, ws_connect(gw) as plain:
        send(ws, op="subscribe", topic="book.x", delta="fossil", id=1)
        send(plain, op="subscribe", topic="book.x", id=1)
        first = collect(ws, lambda got: any(e["type"] == "subscribed" for e in got))
        assert first[-1]["delta"] is True
        assert "delta" not in collect(plain, lambda got: any(e["type"] == "subscribed" for e in got))[-1]
        published = [book(step) for step in range(6)]
        for data in published:
            publish(gw, "book.x", data)
        got = collect(ws, lambda got: len(messages(got)) == 6)
        assert [e["delta"] for e in messages(got)] == [False] + [True] * 5  # the first one whole
        assert rebuild(got) == published
        assert all(len(e["data"]) < 100 for e in messages(got)[1:])  # three levels changed, not 40
        plain_got = messages(collect(plain, lambda got: len(messages(got)) == 6))
        assert [e["data"] for e in plain_got] == published and all("delta" not in e for e in plain_got)


def test_a_resume_and_a_lagging_subscriber_get_the_first_message_whole(gw) -> None:
    published = [book(step) for step in range(10)]
    for data in published[:4]:
        publish(gw, "book.y", data)
    with ws_connect(gw) as ws:
        # since seq 2: 2 and 3 come from the ring, the first whole, the next a delta of it
        send(ws, op="subscribe", topic="book.y", delta="fossil", since={"epoch": epoch_of(gw, "book.y"), "seq": 2})
        got = collect(ws, lambda got: len(messages(got)) == 2)
        assert [e["delta"] for e in messages(got)] == [False, True]
        for data in published[4:]:
            publish(gw, "book.y", data)
        got += collect(ws, lambda more: len(messages(more)) == 6)
        assert rebuild(got) == published[2:]


def epoch_of(gw: Any, topic: str) -> str:
    info = web.get(f"{gw.http_url}/api/topics/{topic}", headers=auth(gw)).json()
    epoch: str = info["epoch"]
    return epoch


def test_snapshot_deltas_and_topics_without_the_rule(gw) -> None:
    with ws_connect(gw) as ws:
        publish(gw, "state.a", {"players": list(range(40)), "tick": 0})
        send(ws, op="subscribe", topic="state.a", delta="fossil", id=1)
        send(ws, op="subscribe", topic="plain.a", delta="fossil", id=2)
        got = collect(ws, lambda got: sum(e["type"] == "subscribed" for e in got) == 2 and messages(got))
        granted = {e["topic"]: e["delta"] for e in got if e["type"] == "subscribed"}
        assert granted == {"state.a": True, "plain.a": False}
        states = [{"players": list(range(40)), "tick": tick} for tick in range(1, 4)]
        for state in states:
            publish(gw, "state.a", state)
            got += collect(ws, lambda more: messages(more))
        assert rebuild(got) == [{"players": list(range(40)), "tick": 0}, *states]
        publish(gw, "plain.a", {"n": 1})
        plain = messages(collect(ws, lambda more: messages(more)))
        assert plain == [{"type": "msg", "topic": "plain.a", "seq": 0, "data": {"n": 1}}]  # not granted: whole


def test_a_bad_delta_request_is_refused_and_nothing_else_is_disturbed(gw) -> None:
    with ws_connect(gw) as ws:
        send(ws, op="subscribe", topic="book.z", delta="zstd", id=1)
        error = collect(ws, lambda got: any(e["type"] == "error" for e in got))[-1]
        assert error["code"] == "bad_command" and error["id"] == 1
        send(ws, op="subscribe", topic="book.z", delta="fossil", id=2)
        assert collect(ws, lambda got: any(e["type"] == "subscribed" for e in got))[-1]["delta"] is True


async def _client_run(gw: Any) -> None:
    published = [book(step) for step in range(12)]
    async with fanout_client.connect(gw.ws_url, backoff_base=0.05, request_timeout=5.0) as client:
        sub = await client.subscribe("book.c", delta="fossil")
        assert sub.delta_granted is True
        for data in published[:6]:
            await asyncio.to_thread(publish, gw, "book.c", data)
        seen = [await sub.get(5) for _ in range(6)]
        # a base gone wrong (as a bug or a bit flip would): the next delta fails its checksum, nothing of it
        # is shown, the client resubscribes from that seq and the gateway sends it whole
        assert sub._delta is not None and sub._delta.text is not None
        sub._delta.text = sub._delta.text.replace(b"100", b"999", 1)
        for data in published[6:]:
            await asyncio.to_thread(publish, gw, "book.c", data)
        seen += [await sub.get(5) for _ in range(6)]
    messages = [event for event in seen if isinstance(event, Message)]
    assert len(messages) == 12
    assert [event.seq for event in messages] == list(range(12))  # no gap, no duplicate
    assert [event.data for event in messages] == published
    assert sub.delta_failures == 1 and sub.deltas_applied >= 8


def test_the_python_client_applies_deltas_and_mends_a_broken_base() -> None:
    with run_gateway(topics=copy.deepcopy(RULES)) as gw:
        asyncio.run(_client_run(gw))


def test_large_or_unrelated_messages_go_whole_and_cost_the_cycle_little() -> None:
    """Issue 45 item 3: 1 MB messages to a topic with one delta subscriber stalled every client 2.7-3.8 s
    (~0.6-0.95 s of fossil encoding a MiB). Past MAX_DELTA_BYTES (64 KiB) a message goes whole; under it, a
    delta that would save less than half is given up early."""
    from core.delta import MAX_DELTA_BYTES

    with run_gateway(topics=RULES, scheduler={"max_message_bytes": 1 << 20}) as gw, ws_connect(gw) as ws:
        send(ws, op="subscribe", topic="book.big", delta="fossil", id=1)
        collect(ws, lambda got: any(e["type"] == "subscribed" for e in got))
        rng = __import__("random").Random(7)
        big = [[rng.random() for _ in range(40000)] for _ in range(2)]  # ~800 KB each, similar halves
        big[1][:20000] = big[0][:20000]
        unrelated = [[rng.random() for _ in range(2500)] for _ in range(2)]  # ~50 KB each, nothing alike
        published = [*big, *unrelated, book(0), book(1)]
        for data in published:
            publish(gw, "book.big", data)
        got = collect(ws, lambda got: len(messages(got)) == len(published), timeout=30)
        assert len(orjson.dumps(big[1])) > MAX_DELTA_BYTES
        assert [e["delta"] for e in messages(got)] == [False, False, False, False, False, True]
        assert rebuild(got) == published
