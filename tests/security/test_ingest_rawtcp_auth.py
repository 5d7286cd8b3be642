"""Shared secrets of the TCP ingest and the raw TCP broadcaster, against a real gateway on loopback.

Every wait is bounded: sockets time out after a few seconds, polls give up after a few seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import socket
import time

import orjson
import pytest
from websockets.sync.client import connect

from gateway.config import ConfigError
from gateway.testing import run_gateway

pytestmark = pytest.mark.timeout(30)

TOKEN = "s3cret"
WAIT_S = 3.0


def wait_for(pred, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------- ingest


class Publisher:
    """An ingest connection: records out, answer lines in (None once the gateway closed it)."""

    def __init__(self, gw) -> None:
        self.sock = socket.create_connection(("127.0.0.1", gw.ingest_port), timeout=WAIT_S)
        self.file = self.sock.makefile("rb")

    def send(self, *records) -> None:
        # All in one write, so the gateway reads them together (nothing arrives after it closes).
        self.sock.sendall(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in records))

    def readline(self) -> dict | None:
        line = self.file.readline()
        return orjson.loads(line) if line else None

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@contextlib.contextmanager
def subscriber(gw, topic: str):
    with connect(gw.ws_url, open_timeout=WAIT_S, max_size=None, compression=None) as ws:
        ws.send(json.dumps({"op": "subscribe", "topic": topic}))
        assert orjson.loads(ws.recv(timeout=WAIT_S))[0]["type"] == "subscribed"
        yield ws


def next_msg(ws) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        msgs = [e for e in orjson.loads(ws.recv(timeout=max(0.01, deadline - time.monotonic()))) if e["type"] == "msg"]
        if msgs:
            return msgs[0]


@pytest.fixture(scope="module")
def tokened():
    """One gateway whose ingest needs TOKEN, for the tests that need nothing else (each its own topic)."""
    with run_gateway(ingest={"token": TOKEN}) as gw:
        yield gw


def test_ingest_right_token_publishes_and_lines_count_the_auth_line(tokened):
    gw = tokened
    with subscriber(gw, "sec.ok") as ws:
        pub = Publisher(gw)
        pub.send({"auth": TOKEN}, {"topic": "sec.ok", "data": 1}, b"not json", {"sync": 7})
        assert pub.readline() == {"type": "authed"}
        error = pub.readline()
        assert (error["type"], error["line"], error["code"]) == ("error", 3, "bad_json")
        assert pub.readline() == {"type": "synced", "id": 7, "accepted": 1, "refused": 1}
        assert next_msg(ws)["data"] == 1
        pub.close()


@pytest.mark.parametrize(
    "first",
    [{"auth": "wrong"}, {"auth": 1}, {"topic": "sec.no", "data": 0}, b"not json", b""],
    ids=["wrong", "not-a-string", "no-auth-line", "not-json", "blank"],
)
def test_ingest_wrong_or_missing_token_is_answered_closed_and_nothing_is_published(tokened, request, first):
    gw = tokened
    topic = f"sec.no.{request.node.callspec.id}"  # the gateway is shared: a topic of this case's own
    if isinstance(first, dict) and "topic" in first:
        first = {**first, "topic": topic}
    bad_before = gw.call(lambda: gw.hub.bad_input.by_source["ingest"])
    with subscriber(gw, topic) as ws:
        pub = Publisher(gw)
        pub.send(first, {"topic": topic, "data": 1}, {"sync": 1})
        error = pub.readline()
        assert (error["type"], error["line"], error["code"]) == ("error", 1, "unauthorized")
        assert pub.readline() is None  # closed; the sync was never answered
        pub.close()
        assert gw.call(lambda: gw.hub.bad_input.by_source["ingest"]) == bad_before + 1
        # Nothing of the refused connection landed: the first message the topic ever gets is this one.
        good = Publisher(gw)
        good.send({"auth": TOKEN}, {"topic": topic, "data": 2}, {"sync": 1})
        assert good.readline() == {"type": "authed"}
        assert good.readline()["type"] == "synced"
        assert next_msg(ws) == {"type": "msg", "topic": topic, "seq": 0, "data": 2}
        good.close()


def test_ingest_without_an_auth_line_in_time_is_closed():
    with run_gateway(ingest={"token": TOKEN}, server={"header_timeout_s": 0.5}) as gw:
        pub = Publisher(gw)
        started = time.monotonic()
        pub.sock.sendall(b'{"auth": "s3c')  # a line never finished
        error = pub.readline()
        assert (error["line"], error["code"]) == (0, "unauthorized")
        assert pub.readline() is None
        assert 0.4 < time.monotonic() - started < WAIT_S
        pub.close()


def test_ingest_auth_line_longer_than_allowed_is_refused_before_buffering_more(tokened):
    pub = Publisher(tokened)
    pub.sock.sendall(b'{"auth": "' + b"x" * 8192)  # no newline
    error = pub.readline()
    assert (error["line"], error["code"]) == (1, "unauthorized")
    assert pub.readline() is None
    pub.close()


def test_ingest_sync_id_must_be_a_scalar_and_the_connection_goes_on():
    deep = b'{"sync": ' + b"[" * 600 + b"]" * 600 + b"}"  # deeper than orjson writes: echoing it raised
    with run_gateway() as gw, subscriber(gw, "sec.sync") as ws:  # no token: an auth line is still accepted
        pub = Publisher(gw)
        pub.send(
            {"auth": "anything"},
            deep,
            {"sync": True},
            {"sync": 1.5},
            {"sync": {"a": 1}},
            {"topic": "sec.sync", "data": 1},
            {"auth": "again"},
            {"sync": None},
            {"sync": "s"},
        )
        assert pub.readline() == {"type": "authed"}
        errors = [pub.readline() for _ in range(5)]
        assert [(e["line"], e["code"]) for e in errors] == [
            (2, "bad_record"),
            (3, "bad_record"),
            (4, "bad_record"),
            (5, "bad_record"),
            (7, "bad_record"),
        ]
        assert pub.readline() == {"type": "synced", "id": None, "accepted": 1, "refused": 5}
        assert pub.readline() == {"type": "synced", "id": "s", "accepted": 0, "refused": 0}
        assert next_msg(ws)["data"] == 1
        pub.close()


def test_ingest_unexpected_exception_costs_one_record_not_the_connection():
    with run_gateway() as gw, subscriber(gw, "sec.ok") as ws:
        publish = gw.hub.catalog.publish_nowait

        def broken(topic, data, **kw):
            if topic == "sec.boom":
                raise RuntimeError("a bug")
            return publish(topic, data, **kw)

        gw.call(setattr, gw.hub.catalog, "publish_nowait", broken)
        pub = Publisher(gw)
        pub.send({"topic": "sec.boom", "data": 0}, {"topic": "sec.ok", "data": 1}, {"sync": 1})
        error = pub.readline()
        assert (error["line"], error["code"]) == (1, "internal_error")
        assert pub.readline() == {"type": "synced", "id": 1, "accepted": 1, "refused": 1}
        assert next_msg(ws)["data"] == 1
        assert gw.call(lambda: gw.hub.bad_input.by_source["ingest"]) == 1
        pub.close()


@pytest.mark.parametrize("section", ["ingest", "rawtcp"])
def test_binding_beyond_loopback_without_a_token_is_refused(section):
    with pytest.raises(ConfigError, match=f"without {section}.token"):
        with run_gateway(**{section: {"enabled": True, "host": "0.0.0.0"}}):
            pass


# ------------------------------------------------------------------------------------------ raw TCP

RAW = {"enabled": True, "token": TOKEN, "max_receivers": 1, "sender_idle_timeout_s": 0.5}


def raw_connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    if first:
        sock.sendall(first)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """What the peer sent before closing the connection (fails after WAIT_S)."""
    got = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


def read_exactly(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        data = sock.recv(n - len(got))
        assert data, "closed early"
        got += data
    return bytes(got)


def raw_stats(gw) -> dict:
    return gw.call(gw.hub.raw.stats)


def authed_receiver(gw) -> socket.socket:
    before = raw_stats(gw)["active_receivers"]
    sock = raw_connect(gw.raw_receiver_port, TOKEN.encode() + b"\n")
    wait_for(lambda: raw_stats(gw)["active_receivers"] == before + 1, "the receiver registered")
    return sock


@pytest.mark.parametrize("first", [b"wrong\n", b"x" * 2048], ids=["wrong-token", "no-newline-in-1KiB"])
def test_raw_wrong_token_is_closed_for_sender_and_receiver(first):
    with run_gateway(rawtcp=RAW) as gw:
        receiver = authed_receiver(gw)
        for port in (gw.raw_sender_port, gw.raw_receiver_port):
            sock = raw_connect(port, first + b"data after it")
            assert read_until_closed(sock) == b""
            sock.close()
        stats = raw_stats(gw)
        assert stats["handshakes_refused"] == 2 and stats["sender_connections"] == 0
        assert stats["active_receivers"] == 1 and stats["bytes_received"] == 0
        assert gw.call(lambda: gw.hub.bad_input.by_source["rawtcp"]) == 2
        receiver.close()


def test_raw_right_token_sender_bytes_reach_an_authenticated_receiver_unchanged():
    payload = random.Random(8).randbytes(300_000)
    with run_gateway(rawtcp=RAW) as gw:
        receiver = authed_receiver(gw)
        # The token line and the data in one write: what follows the newline is data, none of it lost.
        sender = raw_connect(gw.raw_sender_port, TOKEN.encode() + b"\n" + payload)
        got = read_exactly(receiver, len(payload))
        assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
        assert raw_stats(gw)["bytes_received"] == len(payload)
        sender.close()
        receiver.close()


def test_raw_unauthenticated_receiver_takes_no_slot_gets_nothing_and_is_closed_at_the_deadline():
    with run_gateway(rawtcp=RAW, server={"header_timeout_s": 1.0}) as gw:
        silent = raw_connect(gw.raw_receiver_port)  # max_receivers is 1: it must not hold that place
        receiver = authed_receiver(gw)
        sender = raw_connect(gw.raw_sender_port, TOKEN.encode() + b"\nhello")
        assert read_exactly(receiver, 5) == b"hello"
        started = time.monotonic()
        assert read_until_closed(silent) == b""  # not a byte before or at its close
        assert time.monotonic() - started < WAIT_S
        stats = raw_stats(gw)
        assert stats["receivers_refused"] == 0 and stats["handshakes_refused"] == 1
        for sock in (silent, receiver, sender):
            sock.close()


def test_raw_idle_sender_is_dropped_and_a_new_sender_can_connect():
    with run_gateway(rawtcp=RAW) as gw:
        receiver = authed_receiver(gw)
        idle = raw_connect(gw.raw_sender_port, TOKEN.encode() + b"\nfirst")
        assert read_exactly(receiver, 5) == b"first"
        started = time.monotonic()
        assert read_until_closed(idle) == b""  # then nothing for sender_idle_timeout_s (0.5 s)
        assert 0.3 < time.monotonic() - started < WAIT_S
        idle.close()
        wait_for(lambda: not raw_stats(gw)["sender_connected"], "the slot freed")
        sender = raw_connect(gw.raw_sender_port, TOKEN.encode() + b"\nsecond")
        assert read_exactly(receiver, 6) == b"second"
        stats = raw_stats(gw)
        assert stats["senders_idle"] == 1 and stats["sender_connections"] == 2
        sender.close()
        receiver.close()
