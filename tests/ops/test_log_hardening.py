"""Log lines a client cannot write or multiply (hardening round 4, docs/operations.md "Logs"), on real
gateways on loopback: a Centrifugo method name holding a newline stays inside its line of the text log of a
real `gateway serve`; 20 clients that stop reading are 20 in `fanout_disconnects_total`, a few lines in the log."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import re
import signal
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.testing import TEST_JWT_SECRET, run_gateway
from tests.gateway.gw_helpers import Ingest, recv_entries, send, serve_process, wait_for, ws_connect

pytestmark = pytest.mark.timeout(90)

#: 32 characters: what the Centrifugo session quotes of a method name it refuses
FORGED = "\n2026-01-01 00:00:00,000 ERROR x"


def test_a_clients_newline_cannot_start_a_line_of_the_text_log(tmp_path: Path) -> None:
    config = (
        '[server]\nport = 0\nadmin_token = "log-hardening"\nlog_level = "info"\nlog_format = "text"\n'
        f'drain_timeout_s = 1\n[auth]\njwt_secret = "{TEST_JWT_SECRET}"\n[ingest]\nport = 0\n'
        "[rawtcp]\nenabled = false\n"
    )
    proc, info = serve_process(tmp_path, config, piped=True)
    try:
        with connect(f"ws://127.0.0.1:{info['http_port']}/connection/websocket", open_timeout=5) as ws:
            ws.send(json.dumps({"id": 1, FORGED + ": forged": 5}))  # a method whose params are no object
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert not [line for line in out.splitlines() if line.startswith("2026-01-01")], out
    [refused] = [line for line in out.splitlines() if "bad request" in line]
    assert "WARNING gateway.input: bad input (centrifugo): bad request: `\\n2026-01-01 00:00:00,000 ERROR x` takes" in refused


def test_slow_consumers_cut_are_each_counted_and_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    config = {
        "websocket": {"write_high_water": 16384, "socket_send_buffer": 8192, "blocked_timeout_s": 0.5},
        "topics": {"rules": [{"pattern": "*", "anonymous": True, "capacity": 256}]},
    }
    pad = "x" * 16000
    with run_gateway(**config) as gw, contextlib.ExitStack() as stack:
        clients = [stack.enter_context(ws_connect(gw, rcvbuf=4096, max_queue=2)) for _ in range(20)]
        try:
            for ws in clients:
                send(ws, op="subscribe", topic="slow")
                assert recv_entries(ws)[0]["type"] == "subscribed"
            publisher = Ingest(gw)
            started = time.monotonic()

            def cut() -> int:
                return int(gw.call(lambda: gw.hub.clients.disconnects[("ws", "slow_consumer")]))

            for _ in range(50):  # none reads: each is write-blocked, then cut
                if cut() == 20:
                    break
                publisher.send(*({"topic": "slow", "data": {"i": i, "pad": pad}} for i in range(50)))
                publisher.sync()
                time.sleep(0.1)
            wait_for(lambda: cut() == 20, "20 slow consumers cut")
            elapsed = time.monotonic() - started
            publisher.close()
        finally:  # at once: each close waits up to 1 s behind its unread frames
            with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
                list(pool.map(lambda ws: ws.close(), clients))
    lines = [r.getMessage() for r in caplog.records if "write-blocked" in r.getMessage()]
    # a burst of 5, then 1 a second (gateway/clients.py): each cut is counted above, not each logged
    assert 1 <= len(lines) <= 5 + elapsed + 1, lines
    assert len(lines) < 20
    said = sum(int(m.group(1)) for line in lines if (m := re.search(r"\((\d+) more not logged\)", line)))
    assert len(lines) + said <= 20
