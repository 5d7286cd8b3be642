"""One anonymous client cannot exhaust what others share: topics, sessions, memory, the publish path, the
encoder (issue 8, limit rows). Limits are made small through config so each test is quick."""

from __future__ import annotations

import json
import socket
import time

import pytest
from websockets.exceptions import ConnectionClosed

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, collect, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)


def deep(levels: int):
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def errors(entries):
    return [e for e in entries if e["type"] == "error"]


def test_topic_names_cannot_fill_the_table_for_good():
    # subscribe_burst raised: 120 commands at once, and what is bounded here is creations, not their rate
    limits = {"limits": {"max_created_topics": 50, "topic_ttl_s": 0.5, "subscribe_burst": 1000}, "scheduler": {"max_topics": 120}}
    with run_gateway(**limits) as gw, ws_connect(gw) as attacker:
        for i in range(60):
            send(attacker, op="subscribe", topic=f"junk.{i}", id=i)
            send(attacker, op="unsubscribe", topic=f"junk.{i}")
        got = collect(attacker, lambda g: len(errors(g)) >= 20, timeout=10)
        refused = [e for e in errors(got) if e["id"] is not None]  # the unsubscribes answer not_subscribed
        assert [e["id"] for e in refused] == list(range(50, 60))  # its own cap: 50 creations
        assert {e["code"] for e in refused} == {"too_many_topics"}
        with ws_connect(gw) as other:  # everyone else still creates topics
            send(other, op="subscribe", topic="chat.fresh", id=1)
            assert recv_entries(other)[0]["type"] == "subscribed"
            deadline = time.monotonic() + 5
            while gw.call(lambda: gw.hub.scheduler.engine.topic_count) > 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            # the 50 unused topics were reclaimed after the TTL; a subscribed one stays
            assert gw.call(lambda: [t.name for t in gw.hub.scheduler.engine.topics()]) == ["chat.fresh"]


def test_long_poll_sessions_per_address_are_bounded():
    with run_gateway(longpoll={"max_sessions_per_ip": 3}) as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        sessions = [http.post("/lp") for _ in range(3)]
        assert all(r.status_code == 201 for r in sessions)
        refused = http.post("/lp")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"
        assert refused.headers["retry-after"] == "5"
        http.delete(f"/lp/{sessions[0].json()['session']}")
        assert http.post("/lp").status_code == 201


def raw_http(port: int, head: bytes, body: bytes = b"", *, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + body)
        if not read:
            return b""
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_oversized_bodies_are_refused_before_they_are_read():
    with run_gateway(longpoll={"max_body_bytes": 1024}) as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        session = http.post("/lp").json()["session"]
        # 256 MiB announced, 10 bytes sent: the answer comes at once, nothing is buffered
        head = (
            f"POST /lp/{session} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {256 << 20}\r\n\r\n"
        ).encode()
        started = time.monotonic()
        answer = raw_http(gw.http_port, head, b'{"op":"pi')
        assert answer.startswith(b"HTTP/1.1 413") and b'"too_large"' in answer
        assert time.monotonic() - started < 3
        # chunked, no length: refused once past the bound while streaming
        head = (f"POST /lp/{session} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        chunk = b"400\r\n" + b" " * 1024 + b"\r\n"
        answer = raw_http(gw.http_port, head, chunk * 3)
        assert answer.startswith(b"HTTP/1.1 413")
        admin = raw_http(
            gw.http_port,
            (
                f"POST /api/topics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {gw.admin_token}\r\n"
                f"Content-Length: {1 << 30}\r\n\r\n"
            ).encode(),
        )
        assert admin.startswith(b"HTTP/1.1 413")


@pytest.fixture(scope="module")
def shared():
    """One default gateway for the two tests that need nothing else (each its own topics)."""
    with run_gateway() as gw:
        yield gw


def test_json_nested_deeper_than_the_encoder_writes_gets_errors_everywhere_and_nothing_breaks(shared):
    nested = deep(600)
    gw = shared
    with (
        ws_connect(gw) as ws,
        ws_connect(gw) as bystander,
        web.Client(base_url=gw.http_url, timeout=10) as http,
    ):
        send(bystander, op="subscribe", topic="chat.x")
        recv_entries(bystander)
        send(ws, op="publish", topic="chat.x", data=nested, id=1)
        send(ws, op="ping", id=nested)
        send(ws, op="rpc", method="echo", params=nested, id=3)
        send(ws, op=nested)
        got = collect(ws, lambda g: len(errors(g)) >= 4)
        assert [e["code"] for e in errors(got)] == ["bad_data", "bad_command", "bad_command", "bad_command"]
        send(ws, op="publish", topic="chat.x", data="after", id=5)  # the connection goes on
        assert recv_entries(ws)[0]["result"] == {"seq": 0}
        assert [e["data"] for e in collect(bystander, lambda g: g)] == ["after"]  # no stall, no false loss
        session = http.post("/lp").json()["session"]
        r = http.post(f"/lp/{session}", content=json.dumps({"op": "publish", "topic": "chat.x", "data": nested}))
        assert r.status_code == 202
        assert http.get(f"/lp/{session}").json()["entries"][0]["code"] == "bad_data"
        r = http.post("/api/topics/chat.x/publish", json={"data": nested}, headers={"Authorization": f"Bearer {gw.admin_token}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_data"
        pub = Ingest(gw)
        pub.send_raw(json.dumps({"topic": "chat.x", "data": nested}).encode() + b"\n")
        pub.send({"topic": "chat.x", "data": "ingest after"})
        assert pub.readline()["code"] == "bad_data"
        assert pub.sync()["accepted"] == 1


def test_client_publishing_is_rate_limited_per_client_and_subscribers_lose_nothing():
    limits = {"limits": {"publish_rate": 20.0, "publish_burst": 30}}
    with run_gateway(**limits) as gw, ws_connect(gw) as flooder, ws_connect(gw) as reader:
        send(reader, op="subscribe", topic="chat.room")
        recv_entries(reader)
        started = time.monotonic()
        for i in range(500):
            send(flooder, op="publish", topic="chat.room", data=i, id=i)
        answers = collect(flooder, lambda g: len(g) >= 500, timeout=10)
        refilled = 20.0 * (time.monotonic() - started)  # what the bucket regained while the frames were read
        accepted = [a for a in answers if a["type"] == "reply"]
        limited = [a for a in answers if a["type"] == "error"]
        assert {a["code"] for a in limited} == {"rate_limited"}
        assert 30 <= len(accepted) <= 30 + refilled + 1 < 500  # the burst, plus the refill
        got = collect(reader, lambda g: len(g) >= len(accepted))
        assert all(e["type"] == "msg" for e in got)  # every accepted message, no loss notice
        with ws_connect(gw) as polite:  # the limit is per client
            send(polite, op="publish", topic="chat.room", data="hi", id=1)
            assert recv_entries(polite)[0]["type"] == "reply"


def test_a_connection_that_subscribes_to_nothing_is_closed_when_idle():
    with run_gateway(limits={"idle_timeout_s": 0.5}) as gw, ws_connect(gw) as idle, ws_connect(gw) as busy:
        send(busy, op="subscribe", topic="chat.a")
        recv_entries(busy)
        with pytest.raises(ConnectionClosed) as info:
            idle.recv(timeout=5)
        assert info.value.rcvd.code == 4012
        time.sleep(0.6)
        send(busy, op="ping", id=1)
        assert recv_entries(busy)[0]["result"] == "pong"


def test_out_of_range_seqs_and_topic_settings_are_refused_not_stored(shared):
    headers = {"Authorization": "Bearer test-token"}
    gw = shared
    with web.Client(base_url=gw.http_url, timeout=10, headers=headers) as http, ws_connect(gw) as ws:
        pub = Ingest(gw)
        for seq in (2**64 - 1, 2**53, -1):
            pub.send({"topic": "t.big", "seq": seq, "data": 1})
            assert pub.readline()["code"] == "bad_seq"
            r = http.post("/api/topics/t.big/publish", json={"data": 1, "seq": seq})
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_seq"
        send(ws, op="subscribe", topic="t.big", id=1)  # the topic still works
        assert recv_entries(ws)[0]["seq"] == 0
        for settings in (
            {"capacity": 1.5},
            {"capacity": 10**30},
            {"capacity": 2**64},
            {"capacity": True},
            {"hole_timeout": True},
            {"client_publish": "false"},
            {"anonymous": 1},
            {"reorder_window": 1.5},
            {"batch_depth": 0},
            {"max_bytes": 2**40},
        ):
            r = http.post("/api/topics", json={"name": "t.settings", **settings})
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", settings
        assert http.get("/api/topics/t.settings").status_code == 404


def test_the_close_code_reaches_a_client_that_keeps_sending():
    # Closing a socket whose peer's bytes are still unread makes the kernel reset the connection, which
    # can destroy the close frame before the client reads it; the gateway lingers instead.
    with run_gateway(scheduler={"direct_queue_max": 16}) as gw:
        for _ in range(10):
            with ws_connect(gw) as ws:
                ws.send(json.dumps([{"op": "ping", "id": i} for i in range(50)]))  # 50 replies > 16
                try:
                    for i in range(300):
                        ws.send(json.dumps({"op": "ping", "id": i}))
                except ConnectionClosed:
                    pass
                with pytest.raises(ConnectionClosed) as info:
                    while True:
                        ws.recv(timeout=5)
                assert info.value.rcvd is not None and info.value.rcvd.code == 4009
