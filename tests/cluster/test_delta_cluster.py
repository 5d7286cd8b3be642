"""Fossil deltas with a Redis broker: a subscriber of one node gets, for messages published on the other, the
delta forms the same as without a broker (the message's text is the one the node encoded from Redis's bytes),
and a subscribe that waited for the broker to bring the topic in still asks for them."""

from __future__ import annotations

import orjson
from centrifuge.fossil import apply_delta  # type: ignore[import-untyped]

from tests.cluster.cluster_helpers import messages, send


def test_deltas_across_two_nodes(nodes):
    first = nodes.start("a", rule={"delta": "fossil"})
    second = nodes.start("b", rule={"delta": "fossil"})
    books = [{"bids": [[100 - i, 10 + i + (step if i == step else 0)] for i in range(30)]} for step in range(5)]
    with second.ws() as ws:
        # the topic does not exist yet: the subscribe waits for the broker to bring it in
        send(ws, op="subscribe", topic="book.c", delta="fossil", id=1)
        got = messages(ws, "book.c", lambda entries: any(e["type"] == "subscribed" for e in entries))
        assert [e for e in got if e["type"] == "subscribed"][0]["delta"] is True
        for data in books:
            assert first.publish("book.c", data).status_code == 200
        entries = [e for e in messages(ws, "book.c", lambda got: sum(e["type"] == "msg" for e in got) >= 5) if e["type"] == "msg"]
    assert [e["delta"] for e in entries] == [False, True, True, True, True]
    base, rebuilt = b"", []
    for entry in entries:
        text = entry["data"].encode()
        base = apply_delta(base, text) if entry["delta"] else text
        rebuilt.append(orjson.loads(base))
    assert rebuilt == books
