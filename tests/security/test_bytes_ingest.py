"""TCP ingest: answers to a publisher that never reads them are flow-controlled (issue 24: +276 MiB), and an
explicit seq past 64 bits is `bad_seq`, as docs/protocol.md says, on the ingest and on the admin API."""

from __future__ import annotations

import gc
import json
import socket
import time

import pytest

from gateway.testing import run_gateway
from gateway.transports.ingest import IngestProtocol
from tests import web
from tests.gateway.gw_helpers import Ingest, auth

pytestmark = pytest.mark.timeout(60)


def _ingest_protocols() -> list[IngestProtocol]:
    return [o for o in gc.get_objects() if isinstance(o, IngestProtocol) and o.transport is not None]


def test_error_lines_to_a_publisher_that_never_reads_are_bounded():
    with run_gateway(ingest={"max_answer_bytes": 65536, "max_buffer_bytes": 65536}) as gw:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gw.ingest_port))
        sock.settimeout(0.2)
        try:
            junk = b"x\n" * 32768  # each line answered with a ~100-byte bad_json error line
            biggest = 0
            paused_at = None
            deadline = time.monotonic() + 20
            # 0.5 s past the pause: unbounded answers would be hundreds of KB more by then
            while time.monotonic() < deadline and (paused_at is None or time.monotonic() < paused_at + 0.5):
                try:
                    sock.send(junk)
                except socket.timeout:
                    pass
                held, paused = gw.call(
                    lambda: (
                        max((p.transport.get_write_buffer_size() for p in _ingest_protocols()), default=0),
                        any(p.write_paused for p in _ingest_protocols()),
                    )
                )
                biggest = max(biggest, held)
                if paused and paused_at is None:
                    paused_at = time.monotonic()  # the kernel's buffers are full: answers wait in ours
            assert paused_at is not None, "the answers never filled the kernel's buffers"
            # without flow control every answer was buffered: MiBs per second once the kernel's were full
            assert biggest <= 65536 + 1024, biggest
        finally:
            sock.close()


def test_a_publisher_that_reads_again_gets_every_answer():
    with run_gateway(ingest={"max_answer_bytes": 4096}) as gw:
        publisher = Ingest(gw)
        try:
            publisher.send_raw(b"x\n" * 2000)  # 2,000 error lines, ~200 KB: past the bound many times
            synced = publisher.sync(1)
            assert synced["refused"] == 2000 and synced["accepted"] == 0
        finally:
            publisher.close()


@pytest.fixture(scope="module")
def shared():
    """One default gateway for the tests that need nothing else (no state is left: every input is refused)."""
    with run_gateway() as gw:
        yield gw


@pytest.mark.parametrize("seq", [10**29, -(10**29), 2**64])
def test_a_seq_past_64_bits_is_bad_seq_on_the_ingest(shared, seq):
    publisher = Ingest(shared)
    try:
        publisher.send_raw(json.dumps({"topic": "chat.a", "seq": seq, "data": 1}).encode() + b"\n")
        answer = publisher.readline()
        assert answer["type"] == "error" and answer["code"] == "bad_seq", answer
        publisher.send_raw(b'{"topic": "chat.a", "seq": 1.5, "data": 1}\n')
        assert publisher.readline()["code"] == "bad_record"  # a fraction is still a wrong type
    finally:
        publisher.close()


def test_a_seq_past_64_bits_is_bad_seq_on_the_admin_api(shared):
    gw = shared
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        answer = http.post("/api/topics/chat.a/publish", headers=auth(gw), content=json.dumps({"data": 1, "seq": 10**29}))
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_seq", answer.text
        answer = http.post("/api/topics/chat.a/publish", headers=auth(gw), content=json.dumps({"data": 1, "seq": 2.5}))
        assert answer.json()["error"]["code"] == "bad_request"
