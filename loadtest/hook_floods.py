"""``python -m loadtest.hook_floods toggle|rpc|connect``: the probes of issue 34's high findings, against a
gateway process of its own with a slow backend, printing what another client (from 127.0.0.2) lost meanwhile:
its messages' delay (admin publish to receipt), its close code if it was closed, the join/leave entries it
got, its hooked rpc outcomes, its own handshakes' outcomes. The victims read at most 20 frames a second
(`--victim-fps`, 0: as fast as frames come), as the finding's members did; the room gets a publish every
100 ms. Figures, not asserts: docs/security.md quotes them. ``--root DIR`` runs the gateway of another
checkout (the figures before a fix).

* toggle: one anonymous WebSocket sends frames of 50 subscribe/unsubscribe pairs of the `join_leave` room the
  victims are members of, as fast as the gateway reads them;
* rpc: one anonymous WebSocket sends 3,000 rpc to the backend's rpc hook (0.5 s to answer), then keeps it full;
* connect: 200 handshakes at a time from 127.0.0.1, each held by the connect hook (1 s to answer), each
  refused one tried again 0.5 s later;
* none: no attacker, the victims' baseline (as in toggle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from loadtest.aio import within
from loadtest.floodprobe import ADMIN_TOKEN, PROBER_ADDRESS, ROOT, FloodGateway, delay_figures

#: how long the backend takes to answer each hook
HOOK_DELAYS = {"rpc": 0.5, "connect": 1.0}
VICTIMS = 4
ROOM = "room.probe"


class SlowBackend:
    """The application's hooks on loopback, in a process of its own (the attackers' loop must not slow its
    answers): every hook allows, after `HOOK_DELAYS`; GET /calls counts the calls per hook."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> str:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.hook_floods", "backend"], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        return self.url

    def calls(self) -> dict[str, int]:
        return dict(httpx.get(f"{self.url}/calls", timeout=10).json())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def serve_backend() -> None:
    """`python -m loadtest.hook_floods backend`: the slow backend; prints its URL, then serves."""
    calls: dict[str, int] = {}

    async def hook(request: Request) -> JSONResponse:
        name = request.path_params["hook"]
        calls[name] = calls.get(name, 0) + 1
        await asyncio.sleep(HOOK_DELAYS.get(name, 0.0))
        answers: dict[str, dict[str, str]] = {"rpc": {"result": "ok"}, "connect": {"user": ""}}  # "": anonymous
        return JSONResponse(answers.get(name, {}))

    async def counts(request: Request) -> JSONResponse:
        return JSONResponse(calls)

    app = Starlette(routes=[Route("/calls", counts), Route("/{hook}", hook, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off", limit_concurrency=10_000)).run(sockets=[sock])


class Victims:
    """`VICTIMS` WebSocket clients from `PROBER_ADDRESS`, members of the room: each message's delay, close codes,
    and (rpc) one hooked rpc each every 0.2 s with its outcome."""

    def __init__(self, url: str, rpc: bool, frames_per_s: float | None) -> None:
        self.url = url
        self.rpc = rpc
        #: a reader of this many frames a second at most (None: as fast as they come)
        self.pause = 1 / frames_per_s if frames_per_s else 0.0
        self.join_leave = 0
        self.delays: list[float] = []
        self.closes: list[str] = []
        self.rpc_outcomes: dict[str, int] = {}
        self.rpc_ms: list[float] = []

    async def one(self, stop: asyncio.Event) -> None:
        async with websockets.connect(self.url, local_addr=(PROBER_ADDRESS, 0), compression=None) as ws:
            await ws.send(json.dumps({"op": "subscribe", "topic": ROOM}))
            asked: dict[int, float] = {}

            async def ask() -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    asked[n] = time.perf_counter()
                    await ws.send(json.dumps({"op": "rpc", "method": "probe", "id": n}))
                    await asyncio.sleep(0.2)

            asker = asyncio.create_task(ask()) if self.rpc else None
            try:
                while not stop.is_set():
                    try:
                        frame = await within(ws.recv(), 0.5)
                    except asyncio.TimeoutError:
                        continue
                    now = time.time()
                    if self.pause:
                        await asyncio.sleep(self.pause)
                    for entry in json.loads(frame):
                        if entry["type"] == "msg" and isinstance(entry.get("data"), dict):
                            self.delays.append(now - entry["data"]["t"])
                        elif entry["type"] in ("join", "leave"):
                            self.join_leave += 1
                        elif entry.get("id") in asked:
                            outcome = entry["type"] if entry["type"] == "reply" else entry.get("code", "?")
                            self.rpc_outcomes[outcome] = self.rpc_outcomes.get(outcome, 0) + 1
                            self.rpc_ms.append((time.perf_counter() - asked.pop(entry["id"])) * 1000)
            except websockets.ConnectionClosed as exc:
                self.closes.append(f"{exc.rcvd.code} {exc.rcvd.reason}" if exc.rcvd else "no close frame")
            finally:
                if asker is not None:
                    asker.cancel()


async def publish_ticks(url: str, stop: asyncio.Event) -> int:
    """An admin publish to the room every 100 ms carrying its send time."""
    sent = 0
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10) as http:
        while not stop.is_set():
            await http.post(f"/api/topics/{ROOM}/publish", json={"data": {"t": time.time()}})
            sent += 1
            await asyncio.sleep(0.1)
    return sent


async def toggle(url: str, stop: asyncio.Event) -> str:
    frame = json.dumps([{"op": op, "topic": ROOM} for _ in range(50) for op in ("subscribe", "unsubscribe")])
    frames = refused = 0
    closed = ""
    try:
        async with websockets.connect(url, compression=None, max_size=None) as ws:
            while not stop.is_set():
                await ws.send(frame)
                frames += 1
                try:
                    while True:
                        for entry in json.loads(await within(ws.recv(), 0.001)):
                            refused += entry["type"] == "error"
                except asyncio.TimeoutError:
                    pass
    except websockets.ConnectionClosed as exc:
        closed = f", then closed {exc.rcvd.code if exc.rcvd else None}"
    return f"toggler: {frames} frames of 50 pairs sent, {refused} commands refused{closed}"


async def no_flood(url: str, stop: asyncio.Event) -> str:
    await stop.wait()
    return "no attacker (the victims' baseline)"


async def rpc_flood(url: str, stop: asyncio.Event) -> str:
    outcomes: dict[str, int] = {}
    closed = ""
    try:
        async with websockets.connect(url, compression=None, max_size=None) as ws:

            async def read() -> None:
                async for frame in ws:
                    for entry in json.loads(frame):
                        key = entry["type"] if entry["type"] == "reply" else entry.get("code", "?")
                        outcomes[key] = outcomes.get(key, 0) + 1

            reader = asyncio.create_task(read())
            for start in range(0, 3000, 100):
                await ws.send(json.dumps([{"op": "rpc", "method": "probe", "id": i} for i in range(start, start + 100)]))
            while not stop.is_set():  # keep it full: one more each 10 ms
                await ws.send(json.dumps({"op": "rpc", "method": "probe", "id": -1}))
                await asyncio.sleep(0.01)
            reader.cancel()
    except websockets.ConnectionClosed as exc:
        closed = f", then closed {exc.rcvd.code if exc.rcvd else None}"
    return f"rpc flooder: outcomes {dict(sorted(outcomes.items()))}{closed}"


async def connect_flood(url: str, stop: asyncio.Event) -> str:
    outcomes: dict[str, int] = {}

    async def hold() -> None:
        while not stop.is_set():
            try:
                async with websockets.connect(url, compression=None, open_timeout=10) as ws:
                    await ws.recv()
                    key = "open"
            except websockets.ConnectionClosed as exc:
                key = str(exc.rcvd.code if exc.rcvd else None)
            except Exception as exc:  # refused at the handshake
                key = type(exc).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
            if key != "open":
                await asyncio.sleep(0.5)  # holding the hook's slots is the attack, not a handshake flood

    tasks = [asyncio.create_task(hold()) for _ in range(200)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return f"connect flooder (200 at a time from 127.0.0.1): outcomes {dict(sorted(outcomes.items()))}"


async def victim_handshakes(url: str, stop: asyncio.Event, outcomes: dict[str, int], times: list[float]) -> None:
    """(connect) A new victim connection from 127.0.0.2 every 0.2 s: its outcome and its time to open."""
    while not stop.is_set():
        started = time.perf_counter()
        try:
            async with websockets.connect(url, local_addr=(PROBER_ADDRESS, 0), compression=None, open_timeout=10) as ws:
                await ws.send(json.dumps({"op": "ping", "id": 1}))
                await within(ws.recv(), 10)
                key = "open"
                times.append((time.perf_counter() - started) * 1000)
        except websockets.ConnectionClosed as exc:
            key = f"{exc.rcvd.code} {exc.rcvd.reason}" if exc.rcvd else "no close frame"
        except Exception as exc:
            key = type(exc).__name__
        outcomes[key] = outcomes.get(key, 0) + 1
        await asyncio.sleep(0.2)


async def run(gateway: FloodGateway, flood: str, seconds: float, victim_fps: float) -> dict[str, Any]:
    ws_url = gateway.url.replace("http", "ws") + "/ws"
    victims = Victims(ws_url, rpc=flood == "rpc", frames_per_s=victim_fps or None)
    stop = asyncio.Event()
    attackers = {"toggle": toggle, "rpc": rpc_flood, "connect": connect_flood, "none": no_flood}
    handshake_outcomes: dict[str, int] = {}
    handshake_ms: list[float] = []
    tasks = [asyncio.create_task(victims.one(stop)) for _ in range(VICTIMS)]
    await asyncio.sleep(2.5 if flood == "connect" else 0.5)  # the victims' own connect hook (connect flood)
    ticker = asyncio.create_task(publish_ticks(gateway.url, stop))
    attacker = asyncio.create_task(attackers[flood](ws_url, stop))
    if flood == "connect":
        tasks.append(asyncio.create_task(victim_handshakes(ws_url, stop, handshake_outcomes, handshake_ms)))
    await asyncio.sleep(seconds)
    stop.set()
    attacker_report = await attacker
    ticks = await ticker
    await asyncio.gather(*tasks, return_exceptions=True)
    figures: dict[str, Any] = {
        "flood": flood,
        "seconds": seconds,
        "victim_fps": victim_fps,
        "attacker": attacker_report,
        "ticks_published": ticks,
        "victims": VICTIMS,
        "victim_messages": len(victims.delays),
        "victim_closes": victims.closes,
        "victim_join_leave_entries": victims.join_leave,
    }
    if victims.delays:
        p50, p99, worst = delay_figures(victims.delays)
        figures["victim_delay_ms"] = {"p50": round(p50 * 1000, 1), "p99": round(p99 * 1000, 1), "max": round(worst * 1000, 1)}
    if flood == "rpc":
        figures["victim_rpc"] = dict(sorted(victims.rpc_outcomes.items()))
        if victims.rpc_ms:
            p50, p99, worst = delay_figures(victims.rpc_ms)
            figures["victim_rpc_ms"] = {"p50": round(p50), "p99": round(p99), "max": round(worst)}
    if flood == "connect":
        figures["victim_handshakes"] = dict(sorted(handshake_outcomes.items()))
        if handshake_ms:
            p50, p99, worst = delay_figures(handshake_ms)
            figures["victim_open_ms"] = {"p50": round(p50), "p99": round(p99), "max": round(worst)}
    return figures


def main() -> None:
    if sys.argv[1:] == ["backend"]:
        serve_backend()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("flood", choices=["toggle", "rpc", "connect", "none"])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--victim-fps",
        type=float,
        default=20.0,
        help="frames a second each victim reads at most (0: as fast as they come); default 20, as the finding's members",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose gateway runs (default: this one)")
    args = parser.parse_args()
    backend = SlowBackend()
    backend_url = backend.start()
    proxy: dict[str, Any] = {"rpc_url": f"{backend_url}/rpc"}
    if args.flood == "connect":
        proxy["connect_url"] = f"{backend_url}/connect"
    rules = [{"pattern": "room.*", "anonymous": True, "presence": True, "join_leave": True}, {"pattern": "*", "anonymous": True}]
    workdir = Path(tempfile.mkdtemp(prefix="hook-floods-"))
    try:
        gateway = FloodGateway(workdir, {"proxy": proxy, "server": {"max_connections_per_ip": 0}}, root=args.root, rules=rules)
        try:
            figures = asyncio.run(run(gateway, args.flood, args.seconds, args.victim_fps))
        finally:
            gateway.stop()
        figures["backend_calls"] = dict(sorted(backend.calls().items()))
        print(json.dumps(figures))
    finally:
        backend.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
