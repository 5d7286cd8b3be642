"""Keepalive pings (`websocket.ping_interval_s`, `ping_timeout_s`; uvicorn's semantics, the deadlines on the
server's timer wheel, gateway/timerwheel.py): a peer that answers is pinged again and again and stays; one
that does not answer is closed with 1011 "keepalive ping timeout". And what an idle connection holds: no
loop timer and no attribute dict of its own (docs/benchmarks.md, idle clients)."""

from __future__ import annotations

import contextlib
import gc
import json
import struct
import threading
import time

import pytest

from gateway.testing import run_gateway
from gateway.transports.ws import WebSocketProtocol, ws_counters
from tests.gateway.gw_helpers import collect, send, wait_for, ws_connect
from tests.security.bytes_helpers import CLOSE, PING, TEXT, RawWs, ws_frame

pytestmark = pytest.mark.timeout(60)

PONG = 0xA
INTERVAL, TIMEOUT = 0.3, 0.3
KEEPALIVE = {"websocket": {"ping_interval_s": INTERVAL, "ping_timeout_s": TIMEOUT}}


def connected(gw) -> int:
    return gw.call(lambda: len(gw.hub.clients.conns))


@pytest.fixture(scope="module")
def keepalive():
    """One gateway with KEEPALIVE for the four tests of it."""
    with run_gateway(**KEEPALIVE) as gw:
        yield gw


@pytest.fixture
def gw(keepalive):
    """The shared gateway once the connections of the test before are gone (the tests count connections)."""
    wait_for(lambda: connected(keepalive) == 0, "the connections of the test before gone")
    return keepalive


def test_a_peer_that_answers_is_pinged_again_and_stays(gw):
    peer = RawWs(gw.http_port)
    try:
        started = time.monotonic()
        pings = []
        for opcode, payload in peer.frames(timeout=3):
            if opcode == PING:
                pings.append(time.monotonic() - started)
                assert peer.send(ws_frame(PONG, payload))
                if len(pings) == 4:
                    break
        assert len(pings) == 4, pings
        # the first after the interval, each next one the interval after the pong (less the round trip),
        # never early and at most a tick of the wheel (a twentieth of the interval) and the loop's lag late
        assert pings[0] >= INTERVAL - 0.01
        for before, after in zip(pings, pings[1:]):
            assert INTERVAL - 0.05 <= after - before <= INTERVAL + 0.25, pings
        assert connected(gw) == 1
    finally:
        peer.close()


def test_a_peer_that_takes_frames_and_acknowledges_them_is_not_pinged_until_they_stop(gw):
    skipped = ws_counters.pings_skipped
    peer = RawWs(gw.http_port, rcvbuf=65536)
    publishing = threading.Event()
    publishing.set()

    def publisher() -> None:
        n = 0
        while publishing.is_set():
            gw.call(gw.hub.catalog.publish_nowait, "ka.flow", n)
            n += 1
            time.sleep(0.03)

    thread = threading.Thread(target=publisher, daemon=True)
    try:
        assert peer.send(ws_frame(TEXT, json.dumps({"op": "subscribe", "topic": "ka.flow", "id": 1}).encode()))
        thread.start()
        started, kinds = time.monotonic(), []
        for opcode, payload in peer.frames(timeout=3):
            kinds.append(opcode)
            if opcode == PING:
                assert peer.send(ws_frame(PONG, payload))
            if time.monotonic() - started > 4 * INTERVAL:
                break
        assert kinds.count(TEXT) > 20 and PING not in kinds, kinds  # the acknowledgements do a pong's work
        assert gw.call(lambda: ws_counters.pings_skipped) - skipped >= 3
        publishing.clear()
        thread.join()
        for opcode, _payload in peer.frames(timeout=3):  # nothing flows: pinged again
            if opcode == PING:
                break
        else:
            raise AssertionError("no ping once the frames stopped")
        assert connected(gw) == 1
    finally:
        publishing.clear()
        peer.close()


def test_a_peer_that_does_not_answer_is_closed_with_1011(gw):
    peer = RawWs(gw.http_port)
    try:
        started = time.monotonic()
        seen = []
        close = None
        for opcode, payload in peer.frames(timeout=5):
            seen.append(opcode)
            if opcode == CLOSE:
                close = (struct.unpack("!H", payload[:2])[0], payload[2:].decode())
                break
        assert seen[0] == PING and close == (1011, "keepalive ping timeout"), (seen, close)
        assert INTERVAL + TIMEOUT - 0.02 <= time.monotonic() - started <= INTERVAL + TIMEOUT + 1.0
        wait_for(lambda: connected(gw) == 0, "the connection unregistered")
    finally:
        peer.close()


def test_unsolicited_and_stale_pongs_change_nothing(gw):
    peer = RawWs(gw.http_port)
    try:
        assert peer.send(ws_frame(PONG, b"nope"))  # no ping in flight: ignored
        for opcode, payload in peer.frames(timeout=3):
            if opcode == PING:
                assert peer.send(ws_frame(PONG, payload + b"x"))  # not this ping's payload: ignored
                break
        close = peer.close_code(timeout=3)  # so its deadline passes: closed as if it never answered
        assert close == 1011
    finally:
        peer.close()


def test_an_idle_connection_holds_no_timer_and_no_attribute_dict():
    def timers() -> int:
        return sum(type(o).__name__ == "TimerHandle" for o in gc.get_objects())

    with run_gateway() as gw, contextlib.ExitStack() as stack:
        gw.call(gc.unfreeze)
        before = gw.call(timers)
        clients = [stack.enter_context(ws_connect(gw)) for _ in range(30)]
        for i, ws in enumerate(clients):
            send(ws, op="subscribe", topic=f"idle.{i % 3}", id=1)
            collect(ws, lambda got: any(e.get("type") == "subscribed" for e in got))

        def census() -> tuple[int, int, int, int, int]:
            gc.unfreeze()
            protos = [
                p
                for p in gw.running.server.server_state.connections
                if isinstance(p, WebSocketProtocol) and p.connection is not None
            ]
            keepalive = type(protos[0]).service.keepalive.wheel
            with_dict = sum(hasattr(p, "__dict__") for p in protos)
            parsers = sum(p.ws is not None for p in protos)
            return len(protos), with_dict, parsers, len(keepalive), timers()

        served, with_dict, parsers, deadlines, after = gw.call(census)
        assert served == 30
        assert with_dict == 0  # every attribute of a connection is in a slot
        assert parsers == 0  # idle between messages: no websockets object held (its parser is the pool's)
        assert deadlines == 30  # each has its ping deadline on the server's wheel...
        assert after - before < 10  # ... not a loop timer of its own (uvicorn's ping, the hub's idle check)
