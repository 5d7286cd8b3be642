"""`server.log_format = "json"` with `server.workers` = 2 (docs/operations.md, "Logs"): every line the
supervisor and its workers write is one JSON object, each worker's naming it and the supervisor's with a
null worker; the kick, the refusal and each worker's drain among them. One process:
tests/gateway/test_json_logs.py."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import connect

from tests.cluster.cluster_helpers import TOKEN


@pytest.mark.timeout(90)
def test_two_workers_log_json_lines_each_naming_its_worker(nodes) -> None:
    node = nodes.start("w", server={"workers": 2, "log_format": "json", "log_level": "info"})
    with pytest.raises(WebSocketException):  # refused at the handshake, or closed at once
        with connect(f"{node.ws_url}?token=not-a-token", open_timeout=5) as ws:
            ws.recv(timeout=5)
    with node.ws() as ws, httpx.Client(base_url=node.http_url, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        deadline = time.monotonic() + 5
        while not (clients := http.get("/api/clients").json()["clients"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        [client] = [c["id"] for c in clients]
        assert http.delete(f"/api/clients/{client}").json() == {"kicked": client}
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000
    assert node.stop() == 0
    records = [json.loads(line) for line in node.log().splitlines() if line.strip()]  # every line is JSON
    assert all({"time", "level", "worker", "event"} <= r.keys() for r in records), node.log()
    assert {r["worker"] for r in records} == {None, 0, 1}, node.log()
    supervisor = [r["event"] for r in records if r["worker"] is None]
    assert any(e.startswith("core: ") for e in supervisor) and any(" workers on http://" in e for e in supervisor)
    kicked = [r for r in records if r.get("reason") == "kicked"]
    assert len(kicked) == 1 and kicked[0]["client"] == client and kicked[0]["worker"] in (0, 1), node.log()
    assert len([r for r in records if "token refused" in r["event"] and r["source"] == "ws"]) == 1, node.log()
    draining = [r["worker"] for r in records if r["event"].startswith("draining:")]
    assert sorted(draining) == [0, 1], node.log()
    assert sorted(
        r["worker"] for r in records if r.get("logger") == "uvicorn.error" and "Started server process" in r["event"]
    ) == [0, 1], node.log()


@pytest.mark.timeout(60)
def test_in_text_every_line_of_a_worker_names_it_uvicorns_too(nodes) -> None:
    node = nodes.start("t", server={"workers": 2, "log_level": "info"})
    assert node.stop() == 0
    started = re.findall(r"^\S+ \S+ INFO (worker \d) uvicorn\.error: Started server process", node.log(), re.M)
    assert sorted(started) == ["worker 0", "worker 1"], node.log()
    assert "INFO:     " not in node.log()  # no line in uvicorn's own format, which names no worker
