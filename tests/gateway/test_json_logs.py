"""`server.log_format = "json"` (docs/operations.md, "Logs"): one JSON object a line, on the real `gateway
serve` process, for the same events as the text format; the config key refused when it is neither format.
With `server.workers` = 2: tests/cluster/test_json_logs_workers.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import connect as ws_connect

from gateway.config import ConfigError, load_config
from gateway.testing import TEST_JWT_SECRET, make_token
from tests import web
from tests.gateway.gw_helpers import ROOT, serve_process

ADMIN = "json-logs-admin-token"
#: RFC 3339, UTC, milliseconds
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def json_lines(output: str) -> list[dict[str, Any]]:
    """Every line of the output as a JSON object with the four keys every line has (else the test fails)."""
    records = []
    for line in output.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)  # raises on a line that is not JSON
        assert isinstance(record, dict) and {"time", "level", "worker", "event"} <= record.keys(), line
        assert RFC3339_MS.match(record["time"]), line
        records.append(record)
    return records


def config_text(log_format: str) -> str:
    return (
        f'[server]\nport = 0\nadmin_token = "{ADMIN}"\nlog_level = "info"\nlog_format = "{log_format}"\n'
        f'drain_timeout_s = 2\n[auth]\njwt_secret = "{TEST_JWT_SECRET}"\n[ingest]\nport = 0\n'
        "[rawtcp]\nenabled = false\n"
    )


def refuse_a_bad_token_and_kick_a_client(http_port: int) -> str:
    """A connection refused for a bad token, then carol connected and kicked through the admin API: her id."""
    ws_url = f"ws://127.0.0.1:{http_port}/ws"
    with pytest.raises(WebSocketException):  # refused at the handshake, or closed at once
        with ws_connect(f"{ws_url}?token=not-a-token", open_timeout=5) as ws:
            ws.recv(timeout=5)
    with (
        ws_connect(f"{ws_url}?token={make_token('carol')}", open_timeout=5) as ws,
        web.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}) as http,
    ):
        deadline = time.monotonic() + 5
        while not (clients := http.get("/api/clients").json()["clients"]) and time.monotonic() < deadline:
            time.sleep(0.05)  # registered once the handshake is done
        [carol] = [c["id"] for c in clients]
        assert http.delete(f"/api/clients/{carol}").json() == {"kicked": carol}
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000
    return str(carol)


def serve_and_stop(tmp_path: Path, log_format: str) -> tuple[str, str, int]:
    """Run `gateway serve`, make it log a refusal, a kick and the drain (SIGTERM): (output, carol, status)."""
    proc, info = serve_process(tmp_path, config_text(log_format), piped=True)
    carol = ""
    try:
        carol = refuse_a_bad_token_and_kick_a_client(info["http_port"])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    return out, carol, proc.returncode


@pytest.mark.timeout(60)
def test_json_format_logs_every_line_as_json_with_the_worker_and_the_fields(tmp_path) -> None:
    out, carol, status = serve_and_stop(tmp_path, "json")
    assert status == 0, out
    records = json_lines(out)
    assert {r["worker"] for r in records} == {0}, out  # one process: worker 0
    refused = [r for r in records if "token refused" in r["event"]]
    assert len(refused) == 1 and refused[0]["level"] == "warning" and refused[0]["source"] == "ws", out
    assert refused[0]["peer"] == "127.0.0.1", out
    kicked = [r for r in records if r.get("reason") == "kicked"]
    assert len(kicked) == 1 and kicked[0]["client"] == carol and kicked[0]["user"] == "carol", out
    drain = [r for r in records if r["event"].startswith("draining:")]
    assert len(drain) == 1 and drain[0]["clients"] == 0, out
    uvicorn = [r for r in records if r.get("logger") == "uvicorn.error"]
    assert any("Started server process" in r["event"] for r in uvicorn), out  # uvicorn's loggers too
    assert not [r for r in records if "color_message" in r], out
    assert any(r["event"].startswith("gateway listening on ") for r in records), out
    assert any(r["event"].startswith("core: ") for r in records), out


@pytest.mark.timeout(60)
def test_text_format_stays_as_it_was_and_logs_the_kick(tmp_path) -> None:
    out, carol, status = serve_and_stop(tmp_path, "text")
    assert status == 0, out
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith("{")], out
    assert [line for line in lines if line.startswith("gateway listening on ")], out
    assert re.search(r"^\S+ \S+ WARNING gateway.input: bad input \(ws\): token refused: ", out, re.M), out
    assert re.search(rf"^\S+ \S+ INFO gateway: kicked {re.escape(carol)} \(kicked\)", out, re.M), out
    assert re.search(r"^\S+ \S+ INFO uvicorn.error: Started server process", out, re.M), out  # uvicorn's too


def test_log_format_is_text_by_default_json_from_the_environment_and_nothing_else() -> None:
    assert load_config(environ={}).server.log_format == "text"
    assert load_config(environ={"GATEWAY_SERVER_LOG_FORMAT": "json"}).server.log_format == "json"
    with pytest.raises(ConfigError, match='server.log_format must be "text" or "json", not \'xml\''):
        load_config(environ={"GATEWAY_SERVER_LOG_FORMAT": "xml"})
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    checked = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**clean, "GATEWAY_SERVER_LOG_FORMAT": "yaml"},
    )
    assert checked.returncode == 2 and "server.log_format" in checked.stderr, checked.stderr
