"""TCP ingest for publishers against a real gateway."""

import random
import time

import pytest

from gateway.testing import make_token, run_gateway
from tests.gateway.gw_helpers import Ingest, collect, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)


def msgs(entries):
    return [e for e in entries if e["type"] == "msg"]


def test_out_of_order_seqs_from_two_connections_are_delivered_in_order():
    rules = {"rules": [{"pattern": "*", "anonymous": True, "capacity": 1024, "reorder_window": 256, "batch_depth": 32}]}
    with run_gateway(topics=rules) as gw, ws_connect(gw) as ws:
        send(ws, op="subscribe", topic="feed")
        recv_entries(ws)
        seqs = list(range(400))
        rng = random.Random(7)
        evens, odds = Ingest(gw), Ingest(gw)
        accepted = 0
        for lo in range(0, 400, 50):  # two producers, interleaved in time, each out of order
            block = seqs[lo : lo + 50]
            rng.shuffle(block)
            for seq in block:
                (evens if seq % 2 == 0 else odds).send({"topic": "feed", "seq": seq, "data": seq})
            accepted += evens.sync(lo)["accepted"] + odds.sync(lo)["accepted"]
        assert accepted == 400
        got = collect(ws, lambda g: len(msgs(g)) >= 400)
        assert [e["seq"] for e in msgs(got)] == seqs
        assert not [e for e in got if e["type"] == "loss"]
        # a retry is refused as already there, which makes it idempotent
        evens.send({"topic": "feed", "seq": 10, "data": 10})
        assert evens.readline()["code"] == "stale_seq"


def test_malformed_lines_get_error_lines_with_their_number_and_the_rest_goes_on():
    with run_gateway(ingest={"max_line_bytes": 1000}) as gw, ws_connect(gw) as ws:
        send(ws, op="subscribe", topic="t")
        recv_entries(ws)
        pub = Ingest(gw)
        pub.send_raw(
            b'{"topic":"t","data":1}\nnot json\n[1]\n{"topic":"t"}\n{"topic":"t","data":2,"seq":-1}\n'
            + b'{"topic":"t","data":"'
            + b"x" * 2000
            + b'"}\n\n{"topic":"t","data":3}\n'
        )
        errors = [pub.readline() for _ in range(5)]
        assert [(e["line"], e["code"]) for e in errors] == [
            (2, "bad_json"),
            (3, "bad_record"),
            (4, "bad_record"),
            (5, "bad_seq"),
            (6, "too_large"),
        ]
        assert pub.sync() == {"type": "synced", "id": 1, "accepted": 2, "refused": 5}
        assert [e["data"] for e in msgs(collect(ws, lambda g: len(msgs(g)) >= 2))] == [1, 3]


def test_a_full_private_queue_stops_reading_the_publisher_until_space_frees():
    rules = {"rules": [{"pattern": "*", "kind": "private", "max_count": 5}]}
    with run_gateway(topics=rules) as gw, ws_connect(gw, query=f"?token={make_token('dave')}") as ws:
        send(ws, op="subscribe", topic="q")
        recv_entries(ws)
        dave = gw.client_of("dave")
        gw.call(lambda: gw.hub.scheduler.engine.mark_idle(dave))  # dave stops taking data
        pub = Ingest(gw)
        pub.send(*({"topic": "q", "client": "dave", "data": i} for i in range(20)))
        pub.send({"sync": "after"})
        assert not pub.has_line(0.5)  # blocked behind the full queue: the sync is not answered
        gw.call(lambda: gw.hub.scheduler.mark_ready(dave))
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 20 and time.monotonic() < deadline:
            got += [e["data"] for e in msgs(recv_entries(ws))]
        assert got == list(range(20))  # nothing lost, nothing doubled, in order
        assert pub.readline() == {"type": "synced", "id": "after", "accepted": 20, "refused": 0}
