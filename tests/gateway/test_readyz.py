"""Readiness (`GET /readyz`, gateway/ops/readiness.py, docs/operations.md): 200 while the gateway takes new
clients, 503 with the reason otherwise; `/healthz` stays liveness. A real `gateway serve` process for the
SIGTERM (the broker outage is in tests/cluster/test_readyz_broker.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from websockets.sync.client import connect

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import serve_process


def start(tmp_path: Path, *server_lines: str) -> tuple[subprocess.Popen[bytes], str]:
    proc, info = serve_process(
        tmp_path,
        "\n".join(
            [
                "[server]",
                'host = "127.0.0.1"',
                "port = 0",
                'admin_token = "readyz-test-token"',
                'log_level = "info"',
                *server_lines,
                "[ingest]",
                "enabled = false",
                "[rawtcp]",
                "enabled = false",
                "[[topics.rules]]",
                'pattern = "*"',
                'kind = "ring"',
                "capacity = 16",
                "anonymous = true",
            ]
        )
        + "\n",
    )
    return proc, f"http://127.0.0.1:{info['http_port']}"


def test_readyz_answers_200_while_serving_and_healthz_stays_liveness():
    with run_gateway() as gw:
        ready = web.get(f"{gw.http_url}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "ready" and "reason" not in ready.json()
        assert ready.json()["worker"] == 0
        assert ready.headers["cache-control"] == "no-store"
        assert web.get(f"{gw.http_url}/healthz", timeout=5).json() == {"status": "ok"}


def test_sigterm_turns_readyz_to_503_draining_at_once_while_the_port_serves_drain_delay_s(tmp_path):
    """The state flips in the signal handler: the first /readyz after SIGTERM answers 503 `draining`; for
    `server.drain_delay_s` the port still serves (a balancer takes the gateway out meanwhile), /healthz
    still answers 200, then the drain closes the port and the process exits 0."""
    proc, base = start(tmp_path, "drain_delay_s = 1.5", "drain_timeout_s = 2")
    try:
        assert web.get(f"{base}/readyz", timeout=5).status_code == 200
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        answer = web.get(f"{base}/readyz", timeout=5)  # a new connection, as a probe makes
        answered = time.monotonic() - sent
        assert answer.status_code == 503, answer.text
        assert answer.json()["reason"] == "draining" and answer.json()["status"] == "unavailable"
        assert answered < 1.0, answered  # generous: the flip itself is immediate (shared, slow machine)
        # still serving during the delay: liveness, and a client that arrives late is still taken
        assert web.get(f"{base}/healthz", timeout=5).status_code == 200
        with connect(base.replace("http", "ws") + "/ws", open_timeout=5) as ws:
            ws.send(json.dumps({"op": "subscribe", "topic": "late"}))
            assert ws.recv(timeout=5)
        print(f"\n/readyz 503 draining answered {answered * 1000:.1f} ms after SIGTERM")
        assert proc.wait(15) == 0
        waited = time.monotonic() - sent
        assert waited >= 1.5, waited  # the delay was kept before the drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
