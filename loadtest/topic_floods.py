"""``python -m loadtest.topic_floods topics|stall|bulk``: the floods of issue 24's topic and broker findings,
against a gateway process of its own, printing the gateway's RSS (start, peak, end) and the /healthz
delay another client sees meanwhile (max, p99). Figures, not asserts: docs/security.md quotes them.

* topics: anonymous WebSocket connections each publish to 100 new `chat.<junk>` topics in one frame, close
  and reconnect, from 8 tasks for `--seconds` (the attack that filled the topic table for good);
* stall: with Redis stopped (SIGSTOP), 48 ingest connections publish 4 KiB records as fast as the gateway
  takes them for `--seconds`;
* bulk: admin publishes of `admin.max_publish_messages` messages one after the other, each followed by a
  6 MB body of 2 M messages (refused 413: over `admin.max_body_bytes`, from its Content-Length, before it is
  read or decoded; before that bound was 2 MiB, it was refused by the message count once decoded) for
  `--seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import httpx
import websockets

from loadtest.floodprobe import ADMIN_TOKEN, FloodGateway, delay_figures, rss_mib
from loadtest.redisproc import RedisProcess

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

#: the stall flood: ingest connections and data bytes of one record (512 records in flight per connection:
#: 48 connections would hold 96 MiB of data without broker.max_pending_bytes)
STALL_CONNECTIONS = 48
RECORD_BYTES = 4096


class Probe(threading.Thread):
    """Another client: GET /healthz every 20 ms (its delay), and the gateway's RSS every 20 ms."""

    def __init__(self, gateway: FloodGateway) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.delays: list[float] = []
        self.rss: list[float] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.gateway.url, timeout=30) as http:
            while not self.stopping.is_set():
                started = time.perf_counter()
                http.get("/healthz")
                self.delays.append(time.perf_counter() - started)
                self.rss.append(rss_mib(self.gateway.proc.pid))
                time.sleep(0.02)

    def report(self, start_rss: float, end_rss: float) -> str:
        median, p99, worst = delay_figures(self.delays)
        return (
            f"RSS start {start_rss:.1f} MiB, peak {max(self.rss):.1f} MiB (+{max(self.rss) - start_rss:.1f}),"
            f" end {end_rss:.1f} MiB; /healthz by another client: {len(self.delays)} probes, max"
            f" {worst * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, median {median * 1000:.1f} ms"
        )


def measure(gateway: FloodGateway, flood: Callable[[], str]) -> None:
    start = rss_mib(gateway.proc.pid)
    probe = Probe(gateway)
    probe.start()
    try:
        print(flood())
    finally:
        probe.stopping.set()
        probe.join()
    print(probe.report(start, rss_mib(gateway.proc.pid)))


def flood_topics(gateway: FloodGateway, seconds: float) -> str:
    url = gateway.url.replace("http", "ws") + "/ws"
    counts = {"ok": 0, "refused": 0, "connections": 0}

    async def attacker(n: int) -> None:
        deadline = time.monotonic() + seconds
        round_ = 0
        while time.monotonic() < deadline:
            round_ += 1
            async with websockets.connect(url, max_size=None, compression=None) as ws:
                counts["connections"] += 1
                frame = [{"op": "publish", "topic": f"chat.j{n}-{round_}-{i}", "data": i, "id": i} for i in range(100)]
                await ws.send(json.dumps(frame))
                answered = 0
                while answered < 100:
                    for entry in json.loads(await ws.recv()):
                        if entry.get("id") is not None:
                            answered += 1
                            counts["ok" if entry["type"] == "reply" else "refused"] += 1

    async def main() -> None:
        await asyncio.gather(*(attacker(n) for n in range(8)))

    asyncio.run(main())
    topics = httpx.get(f"{gateway.url}/api/topics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30).json()[
        "topics"
    ]
    return (
        f"topics flood, {seconds:g} s: {counts['connections']} connections, {counts['ok']} publishes"
        f" accepted (creations), {counts['refused']} refused too_many_topics; topics held: {len(topics)}"
    )


def _stall_publishers(port: int, seconds: float, out: Queue[tuple[int, int]]) -> None:
    """In a child process (the probe's thread must not share a GIL with the load): STALL_CONNECTIONS ingest
    connections written to as fast as the gateway reads, their answers read and counted."""
    import selectors

    record = json.dumps({"topic": "stall", "data": "x" * RECORD_BYTES}).encode() + b"\n"
    chunk = record * 4
    selector = selectors.DefaultSelector()
    for _ in range(STALL_CONNECTIONS):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    sent = answers = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for key, events in selector.select(0.05):
            sock = cast(socket.socket, key.fileobj)  # the selector holds only these sockets
            if events & selectors.EVENT_WRITE:
                try:
                    sock.send(chunk)
                    sent += 4
                except BlockingIOError:
                    pass
            if events & selectors.EVENT_READ:
                try:
                    answers += sock.recv(1 << 20).count(b"\n")
                except BlockingIOError:
                    pass
    out.put((sent, answers))


def flood_stall(gateway: FloodGateway, redis: RedisProcess, seconds: float) -> str:
    import multiprocessing

    redis.stall(True)
    try:
        results: multiprocessing.Queue = multiprocessing.Queue()
        child = multiprocessing.Process(target=_stall_publishers, args=(gateway.info["ingest_port"], seconds, results))
        child.start()
        sent, answers = results.get(timeout=seconds + 30)
        child.join()
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    finally:
        redis.stall(False)
    pending = [line for line in metrics.splitlines() if line.startswith("fanout_broker_")]
    return f"stall flood, {seconds:g} s with Redis stopped: {sent} records sent, {answers} answer lines; " + "; ".join(pending)


def flood_bulk(gateway: FloodGateway, seconds: float, count: int, huge_too: bool) -> str:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    small = json.dumps({"messages": list(range(count))}).encode()
    huge = json.dumps({"messages": [0] * 2_000_000}).encode()  # 6 MiB: 2 M messages
    done = {"bulk": 0, "refused_huge": 0}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        while time.monotonic() < deadline:
            reply = http.post("/api/topics/chat.bulk/publish", content=small, headers=headers)
            done["bulk"] += reply.status_code == 200
            if huge_too:
                reply = http.post("/api/topics/chat.bulk/publish", content=huge, headers=headers)
                done["refused_huge"] += reply.status_code == 413
    return (
        f"bulk flood, {seconds:g} s: {done['bulk']} publishes of {count} messages, {done['refused_huge']}"
        f" bodies of 2 M messages refused 413"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("flood", choices=["topics", "stall", "bulk"])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--no-huge", action="store_true", help="bulk: only the publishes within the bound")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="floods-"))
    redis = None
    sections: dict[str, dict] = {}
    try:
        if args.flood == "stall":
            redis = RedisProcess(workdir / "redis")
            redis.start()
            sections["broker"] = {"url": redis.url}
            # each ingest connection's read buffer is its own bound (4 MiB by default: 48 connections could
            # hold 192 MiB there); kept small so the figures show what waits for Redis
            sections["ingest"] = {"max_buffer_bytes": 262144}
            if os.environ.get("FLOOD_PENDING") is not None:
                sections["broker"]["max_pending_bytes"] = int(os.environ["FLOOD_PENDING"])
        gateway = FloodGateway(workdir, sections)
        try:
            if args.flood == "topics":
                measure(gateway, lambda: flood_topics(gateway, args.seconds))
            elif args.flood == "stall":
                assert redis is not None
                measure(gateway, lambda: flood_stall(gateway, redis, args.seconds))
            else:
                measure(gateway, lambda: flood_bulk(gateway, args.seconds, 10_000, not args.no_huge))
        finally:
            gateway.stop()
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
