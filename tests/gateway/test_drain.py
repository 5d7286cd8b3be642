"""Graceful drain under load (docs/reliability.md, "Graceful drain"): a real `gateway serve` process, 30
WebSocket clients, an SSE stream, a long-poll session and a TCP ingest publisher, publishes going on; SIGTERM.
Every client is told 1012 with its own reconnect hint, new connections are refused, the process exits 0
within `server.drain_timeout_s` plus a margin."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import orjson
import pytest
import websockets

from tests import web
from tests.gateway.gw_helpers import serve_process

TOKEN = "drain-test-token"
CLIENTS = 30
DRAIN_TIMEOUT_S = 5.0
SPREAD_S = 2.0
HINT = re.compile(r"restarting: reconnect in (\d+) ms")


def start(tmp_path: Path, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> tuple[subprocess.Popen[bytes], dict]:
    return serve_process(
        tmp_path,
        "\n".join(
            [
                "[server]",
                'host = "127.0.0.1"',
                "port = 0",
                f'admin_token = "{TOKEN}"',
                'log_level = "info"',
                "max_connections_per_ip = 0",
                f"drain_timeout_s = {drain_timeout_s}",
                f"drain_spread_s = {SPREAD_S}",
                "[ingest]",
                "port = 0",
                "[rawtcp]",
                "enabled = false",
                "[[topics.rules]]",
                'pattern = "*"',
                'kind = "ring"',
                "capacity = 64",
                "anonymous = true",
                "client_publish = true",
            ]
        )
        + "\n",
    )


async def ws_client(url: str, subscribed: asyncio.Event, counter: list[int]) -> tuple[int | None, str]:
    async with websockets.connect(url) as ws:
        await ws.send(orjson.dumps({"op": "subscribe", "topic": "load"}).decode())
        try:
            async for frame in ws:
                if any(e.get("type") == "msg" for e in orjson.loads(frame)):
                    counter[0] += 1
                    subscribed.set()
        except websockets.ConnectionClosed:
            pass
        return ws.close_code, ws.close_reason or ""


async def sse_session(base: str) -> dict:
    async with web.AsyncClient(base_url=base, timeout=30) as http:
        async with http.stream("GET", "/sse?topics=load") as r:
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "close":
                    return orjson.loads(line[6:])
                elif not line:
                    event = None
    raise AssertionError("the SSE stream ended without a close event")


async def longpoll_session(base: str) -> dict:
    async with web.AsyncClient(base_url=base, timeout=30) as http:
        sid = (await http.post("/lp")).json()["session"]
        await http.post(f"/lp/{sid}", json={"op": "subscribe", "topic": "load"})
        ack = None
        while True:
            r = await http.get(f"/lp/{sid}", params={} if ack is None else {"ack": ack})
            body = r.json()
            for entry in body["entries"]:
                if entry.get("type") == "error" and entry.get("code") == "closed":
                    return entry
            ack = body["batch"]
            await asyncio.sleep(0.05)  # between two polls: the closed body waits for the next one


async def publisher(ingest_port: int, stop: asyncio.Event) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", ingest_port)
    sent = 0
    try:
        while not stop.is_set():
            writer.write(orjson.dumps({"topic": "load", "data": {"n": sent}}) + b"\n")
            sent += 1
            await writer.drain()
            await asyncio.sleep(0.005)
    except (ConnectionError, OSError):
        pass
    writer.close()
    return sent


@pytest.mark.timeout(90)
def test_sigterm_drains_every_transport_under_load_and_exits_0(tmp_path):
    proc, info = start(tmp_path)
    base = f"http://127.0.0.1:{info['http_port']}"
    try:
        asyncio.run(_drain_under_load(proc, base, info))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    log = (tmp_path / "gateway.log").read_text()
    assert "drained in" in log, log[-3000:]


async def _drain_under_load(proc: subprocess.Popen[bytes], base: str, info: dict) -> None:
    ws_url = f"ws://127.0.0.1:{info['http_port']}/ws"
    stop = asyncio.Event()
    pub = asyncio.create_task(publisher(info["ingest_port"], stop))
    events = [asyncio.Event() for _ in range(CLIENTS)]
    counters = [[0] for _ in range(CLIENTS)]
    clients = [asyncio.create_task(ws_client(ws_url, events[i], counters[i])) for i in range(CLIENTS)]
    sse = asyncio.create_task(sse_session(base))
    lp = asyncio.create_task(longpoll_session(base))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 20)  # every client receives
    await asyncio.sleep(0.3)

    sent_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*clients), 15)
    closed_at = time.monotonic()
    # draining: the listening ports are closed, a new connection is refused (the process still runs)
    refused_http = refused_ingest = False
    try:
        async with web.AsyncClient(timeout=2) as fresh:
            await fresh.get(f"{base}/healthz")
    except httpx.ConnectError:
        refused_http = True
    try:
        _, w = await asyncio.open_connection("127.0.0.1", info["ingest_port"])
        w.close()
    except ConnectionRefusedError:
        refused_ingest = True
    sse_close = await asyncio.wait_for(sse, 15)
    lp_closed = await asyncio.wait_for(lp, 15)
    stop.set()
    await pub
    code = await asyncio.to_thread(proc.wait, DRAIN_TIMEOUT_S + 10)
    exited_at = time.monotonic()

    assert code == 0
    assert refused_http and refused_ingest
    hints = []
    for close_code, reason in results:
        assert close_code == 1012, (close_code, reason)
        match = HINT.fullmatch(reason)
        assert match, reason
        hints.append(int(match.group(1)))
    assert all(0 <= h <= SPREAD_S * 1000 for h in hints)
    assert len(set(hints)) > CLIENTS // 2, hints  # spread, not one instant for everyone
    assert max(hints) - min(hints) > SPREAD_S * 1000 / 4, hints
    assert sse_close["code"] == 1012 and 0 <= sse_close["retry_ms"] <= SPREAD_S * 1000
    assert HINT.fullmatch(sse_close["reason"])
    assert lp_closed["close_code"] == 1012 and 0 <= lp_closed["retry_ms"] <= SPREAD_S * 1000
    assert exited_at - sent_at < DRAIN_TIMEOUT_S + 3, exited_at - sent_at
    print(
        f"\ndrain: clients closed {closed_at - sent_at:.2f} s after SIGTERM, process exited after"
        f" {exited_at - sent_at:.2f} s; hints {min(hints)}..{max(hints)} ms, {len(set(hints))} distinct of"
        f" {len(hints)}, mean {sum(hints) / len(hints):.0f} ms"
    )


def test_drain_timeout_0_closes_at_once_with_1001_and_exits_0(tmp_path):
    proc, info = start(tmp_path, drain_timeout_s=0)
    try:

        async def one() -> tuple[int | None, str]:
            async with websockets.connect(f"ws://127.0.0.1:{info['http_port']}/ws") as ws:
                await ws.send(orjson.dumps({"op": "subscribe", "topic": "load"}).decode())
                await ws.recv()
                proc.send_signal(signal.SIGTERM)
                try:
                    async for _ in ws:
                        pass
                except websockets.ConnectionClosed:
                    pass
                return ws.close_code, ws.close_reason or ""

        assert asyncio.run(one()) == (1001, "server shutting down")
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_long_poll_session_between_polls_gets_its_1012_and_an_abandoned_one_holds_the_drain_to_its_end(tmp_path):
    proc, info = start(tmp_path, drain_timeout_s=2.0)
    base = f"http://127.0.0.1:{info['http_port']}"

    async def main() -> tuple[dict, float, bool]:
        async with (
            web.AsyncClient(base_url=base, timeout=10) as polling,
            web.AsyncClient(base_url=base, timeout=10) as abandoning,
        ):
            sid = (await polling.post("/lp")).json()["session"]
            await abandoning.post("/lp")  # never polled again
            sent_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            # the next poll, on the keep-alive connection already open, fetches the session's last body
            body = (await polling.get(f"/lp/{sid}")).json()
            await asyncio.sleep(0.5)
            still_running = proc.poll() is None  # waiting for the other session's next poll
            code = await asyncio.to_thread(proc.wait, 10)
            assert code == 0
            return body, time.monotonic() - sent_at, still_running

    try:
        body, took, still_running = asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert body["batch"] is None and len(body["entries"]) == 1
    entry = body["entries"][0]
    assert (entry["code"], entry["close_code"]) == ("closed", 1012)
    assert entry["message"] == f"restarting: reconnect in {entry['retry_ms']} ms"
    assert still_running
    assert 1.9 <= took < 2.0 + 3, took
    assert "1 long-poll bodies not fetched" in (tmp_path / "gateway.log").read_text()


def test_the_ingest_answers_what_it_received_then_closes(tmp_path):
    proc, info = start(tmp_path, drain_timeout_s=3.0)

    async def main() -> tuple[list[dict], bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", info["ingest_port"])
        writer.write(b"".join(orjson.dumps({"topic": "load", "data": i}) + b"\n" for i in range(2000)) + b'{"sync": 1}\n')
        await writer.drain()
        proc.send_signal(signal.SIGTERM)
        lines = [orjson.loads(await asyncio.wait_for(reader.readline(), 5))]
        rest = await asyncio.wait_for(reader.read(), 5)  # then the end of the connection
        writer.close()
        return lines, rest

    try:
        lines, rest = asyncio.run(main())
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert lines == [{"type": "synced", "id": 1, "accepted": 2000, "refused": 0}]
    assert rest == b""
