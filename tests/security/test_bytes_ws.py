"""WebSocket: what a client that never reads, or frames badly, can make the gateway hold or spend is bounded
in bytes (issue 24): pongs, replies (`rpc echo`, `rpc topics`), fragments. Black-box over real sockets."""

from __future__ import annotations

import json
import time

import pytest

from gateway.testing import run_gateway
from gateway.transports.ws import PARSE_SLICE
from tests.gateway.gw_helpers import collect, send, wait_for, ws_connect
from tests.security.bytes_helpers import CONT, PING, TEXT, RawWs, only_client, ws_frame

pytestmark = pytest.mark.timeout(60)

HIGH_WATER = 65536


def test_a_ping_flood_from_a_client_that_never_reads_is_bounded_and_cut():
    with run_gateway(websocket={"blocked_timeout_s": 1.0}) as gw:
        attacker = RawWs(gw.http_port)
        try:
            cid = only_client(gw)
            biggest = 0
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                attacker.flood(ws_frame(PING, b"x" * 125), 0.1)
                held = gw.call(
                    lambda: (
                        gw.hub.clients.conns[cid].proto.transport.get_write_buffer_size() if cid in gw.hub.clients.conns else 0
                    )
                )
                biggest = max(biggest, held)
            # uvicorn wrote every pong: MiBs in a second. Now the write buffer stops near the high-water mark:
            # the pongs of one parse slice (PARSE_SLICE of pings) at most past it, then one held pong
            assert biggest <= HIGH_WATER + PARSE_SLICE + 200, biggest
            # and the write-blocked client is cut as a slow consumer (4008), pings or not
            wait_for(lambda: gw.call(lambda: cid not in gw.hub.clients.conns), "the slow consumer's cut", timeout=10)
            assert gw.call(lambda: gw.hub.clients.disconnects[("ws", "slow_consumer")]) == 1
        finally:
            attacker.close()


@pytest.fixture(scope="module")
def shared():
    """One default gateway for the tests that need nothing else (each its own connection; no topic is made
    but test_rpc_topics_lists_at_most_1000_and_is_rate_limited's)."""
    with run_gateway() as gw:
        yield gw


def test_a_held_pong_is_written_once_the_client_reads(shared):
    with ws_connect(shared) as ws:
        pong = ws.ping(b"p1")
        assert pong.wait(5)
        send(ws, op="ping", id=1)
        assert collect(ws, lambda got: any(e["type"] == "reply" for e in got))[0]["result"] == "pong"


def test_replies_to_a_client_that_never_reads_are_bounded_in_bytes():
    # 60 KB echoes: the count bound (1024 replies) let one connection make the gateway hold 59 MiB
    with run_gateway(scheduler={"direct_queue_max_bytes": 1 << 20}) as gw:
        attacker = RawWs(gw.http_port)
        try:
            cid = only_client(gw)
            echo = json.dumps({"op": "rpc", "method": "echo", "params": "x" * 60_000}).encode()
            most = 0
            for _ in range(40):  # 2.4 MB of replies asked for
                if not attacker.send(ws_frame(TEXT, echo), timeout=2):
                    break
                queued = gw.call(
                    lambda: (
                        sum(len(e) for e in gw.hub.scheduler.engine.client(cid).direct or ())
                        if gw.hub.scheduler.engine.has_client(cid)
                        else 0
                    )
                )
                most = max(most, queued)
            wait_for(lambda: gw.call(lambda: cid not in gw.hub.clients.conns), "the 4009 cut")
            assert gw.call(lambda: gw.hub.clients.disconnects[("ws", "direct_queue_full")]) == 1
            assert most <= (1 << 20), most
            assert gw.call(lambda: gw.hub.scheduler.engine.direct_bytes) == 0  # nothing left behind
        finally:
            attacker.close()


def test_rpc_topics_lists_at_most_1000_and_is_rate_limited(shared):
    gw = shared
    with ws_connect(gw) as ws:
        gw.call(lambda: [gw.hub.scheduler.engine.resolve(f"chat.t{i}") for i in range(1500)])
        send(ws, op="rpc", method="topics", params=None, id=1)
        reply = collect(ws, lambda got: any(e.get("id") == 1 for e in got))[-1]
        assert reply["type"] == "reply" and len(reply["result"]) == 1000
        assert reply["result"][0]["name"] == "chat.t0"
        for i in range(2, 8):
            send(ws, op="rpc", method="topics", params=None, id=i)
        got = collect(ws, lambda got: any(e.get("id") == 7 for e in got))
        assert [e["type"] for e in got if e.get("id") in range(2, 8)] == ["reply"] * 4 + ["error"] * 2
        assert {e["code"] for e in got if e["type"] == "error"} == {"rate_limited"}


@pytest.mark.parametrize("fragments,closed", [(64, False), (65, True)])
def test_a_message_in_too_many_fragments_is_closed_with_1008(shared, fragments, closed):
    client = RawWs(shared.http_port, rcvbuf=65536)
    try:
        command = json.dumps({"op": "ping", "id": 1}).ljust(fragments)
        parts = [ws_frame(TEXT, command[0].encode(), fin=False)]
        parts += [ws_frame(CONT, c.encode(), fin=False) for c in command[1:-1]]
        parts.append(ws_frame(CONT, command[-1].encode()))
        client.send(b"".join(parts))
        if closed:
            assert client.close_code() == 1008
        else:
            opcode, payload = next(client.frames())
            assert opcode == TEXT and json.loads(payload)[0]["result"] == "pong"
    finally:
        client.close()


def test_one_byte_fragments_cost_one_slice_of_parsing_at_most(shared):
    """A flood of one-byte fragments is closed at the 65th and the rest of the read is not parsed."""
    client = RawWs(shared.http_port, rcvbuf=65536)
    try:
        flood = ws_frame(TEXT, b"[", fin=False) + ws_frame(CONT, b" ", fin=False) * 200_000
        client.send(flood, timeout=2)
        assert client.close_code() == 1008
    finally:
        client.close()
