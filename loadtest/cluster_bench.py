"""``python -m loadtest cluster``: the gateway with and without Redis (docs/cluster.md), figures only.

1. deliveries/s and gateway CPU per delivery, same multi-topic load, for: 1 process in-process, 1 process
   on Redis, `server.workers = 2` on Redis (Redis's own CPU reported beside);
2. cross-node publish-to-delivery latency: subscribers on node A, publishes into node B's ingest;
3. recovery after kill -9: a subscriber's node is killed; time until it has reconnected to the other node
   and recovered, with `since`, every message published meanwhile.

Starts its own redis-server (/usr/bin/redis-server) and gateways on free loopback ports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from websockets.asyncio.client import connect

from loadtest.aio import within
from loadtest.procstat import read_stat, tree
from loadtest.redisproc import RedisProcess

TOKEN = "cluster-bench"


def _cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        stat = read_stat(p)
        if stat is not None:
            total += stat[1]
    return total


class Gateway:
    def __init__(self, workdir: Path, broker: str, workers: int = 1) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "gateway.toml"
        config.write_text(f"""[server]
host = "127.0.0.1"
port = 0
admin_token = "{TOKEN}"
log_level = "warning"
max_connections_per_ip = 0
workers = {workers}
drain_timeout_s = 2.0  # a run's end: no client waits to be handed over
[ingest]
port = 0
[rawtcp]
enabled = false
[broker]
url = "{broker}"
[[topics.rules]]
pattern = "*"
kind = "ring"
capacity = 1024
anonymous = true
""")
        ready = workdir / "ready.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file", str(ready)],
            env=env,
            stdout=open(workdir / "gateway.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"gateway did not start: {(workdir / 'gateway.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        self.port = self.info["http_port"]
        self.ingest_port = self.info["ingest_port"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _subscriber(
    port: int, topics: list[str], counts: list[int], latencies: list[float], ready: asyncio.Event, want: int, stop: asyncio.Event
) -> None:
    async with connect(f"ws://127.0.0.1:{port}/ws", max_size=None, compression=None) as ws:
        for topic in topics:
            await ws.send(orjson.dumps({"op": "subscribe", "topic": topic}).decode())
        subscribed = 0
        while subscribed < len(topics):
            subscribed += sum(e["type"] == "subscribed" for e in orjson.loads(await ws.recv()))
        counts[1] += 1
        if counts[1] == want:
            ready.set()
        while not stop.is_set():
            try:
                frame = await within(ws.recv(), 0.5)
            except asyncio.TimeoutError:
                continue
            now = time.time()
            for entry in orjson.loads(frame):
                if entry["type"] == "msg":
                    counts[0] += 1
                    if len(latencies) < 200_000:
                        latencies.append(now - entry["data"]["t"])


async def _publish(port: int, topics: list[str], rate: float, duration: float) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    start = time.monotonic()
    tick = 0.01
    while (elapsed := time.monotonic() - start) < duration:
        due = int(elapsed * rate) - sent
        if due > 0:
            now = time.time()
            writer.write(
                b"".join(
                    orjson.dumps({"topic": topics[(sent + i) % len(topics)], "data": {"t": now, "pad": "x" * 64}}) + b"\n"
                    for i in range(due)
                )
            )
            sent += due
            await writer.drain()
        await asyncio.sleep(tick)
    writer.write(b'{"sync": 1}\n')
    await writer.drain()
    await reader.readline()
    writer.close()
    return sent


async def _load(
    sub_ports: list[int], pub_port: int, pids: list[int], clients: int, topics: int, per_client: int, rate: float, duration: float
) -> dict:
    names = [f"bench.{i}" for i in range(topics)]
    counts = [0, 0]
    latencies: list[float] = []
    ready, stop = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(
            _subscriber(
                sub_ports[i % len(sub_ports)],
                [names[(i + k) % topics] for k in range(per_client)],
                counts,
                latencies,
                ready,
                clients,
                stop,
            )
        )
        for i in range(clients)
    ]
    await within(ready.wait(), 60)
    cpu0 = sum(_cpu(p) for p in pids)
    t0 = time.monotonic()
    sent = await _publish(pub_port, names, rate, duration)
    await asyncio.sleep(1.0)  # the last deliveries
    elapsed = time.monotonic() - t0
    cpu = sum(_cpu(p) for p in pids) - cpu0
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    latencies.sort()
    delivered = counts[0]
    return {
        "published": sent,
        "delivered": delivered,
        "deliveries_per_s": delivered / elapsed,
        "expected": sent * clients * per_client // topics,
        "cpu_s": cpu,
        "cpu_us_per_delivery": cpu / max(1, delivered) * 1e6,
        "p50_ms": latencies[len(latencies) // 2] * 1e3 if latencies else None,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else None,
    }


async def _recovery(a: Gateway, b: Gateway, messages: int) -> dict:
    """Subscriber on A, A killed, the subscriber reconnects to B with `since` while B's publishes go on."""
    topic = "bench.recovery"
    async with connect(f"ws://127.0.0.1:{a.port}/ws", compression=None) as ws:
        await ws.send(orjson.dumps({"op": "subscribe", "topic": topic}).decode())
        epoch = next(e for e in orjson.loads(await ws.recv()) if e["type"] == "subscribed")["epoch"]
        reader, writer = await asyncio.open_connection("127.0.0.1", b.ingest_port)
        writer.write(orjson.dumps({"topic": topic, "data": {"t": 0}}) + b"\n")
        await writer.drain()
        last = -1
        while last < 0:
            for e in orjson.loads(await ws.recv()):
                if e["type"] == "msg":
                    last = e["seq"]
    killed = time.monotonic()
    a.proc.send_signal(signal.SIGKILL)
    writer.write(b"".join(orjson.dumps({"topic": topic, "data": {"t": i}}) + b"\n" for i in range(messages)))
    await writer.drain()
    async with connect(f"ws://127.0.0.1:{b.port}/ws", compression=None) as ws:
        await ws.send(orjson.dumps({"op": "subscribe", "topic": topic, "since": {"epoch": epoch, "seq": last + 1}}).decode())
        got, lost = 0, 0
        while got + lost < messages:
            for e in orjson.loads(await ws.recv()):
                if e["type"] == "msg":
                    got += 1
                elif e["type"] == "loss":
                    lost += e["to"] - e["from"]
    writer.close()
    return {"recovered": got, "announced_lost": lost, "recovery_ms": (time.monotonic() - killed) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--topics", type=int, default=20)
    parser.add_argument("--per-client", type=int, default=2, help="topics each client subscribes to")
    parser.add_argument("--rate", type=float, default=1000.0, help="publishes/s (TCP ingest)")
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    redis = RedisProcess(workdir / "redis")
    redis.start()
    assert redis.proc is not None  # started
    redis_pid = redis.proc.pid
    load = (args.clients, args.topics, args.per_client, args.rate, args.duration)
    print(
        f"load: {args.clients} clients x {args.per_client} of {args.topics} topics, {args.rate:g} publishes/s"
        f" for {args.duration:g} s (TCP ingest), ring capacity 1024"
    )
    try:
        for label, broker, workers in (
            ("1 worker, in-process", "", 1),
            ("1 worker, Redis", redis.url, 1),
            ("2 workers, Redis", redis.url, 2),
        ):
            gw = Gateway(workdir / label.replace(" ", "").replace(",", "-"), broker, workers)
            try:
                redis_cpu0 = _cpu(redis_pid)
                figures = asyncio.run(_load([gw.port], gw.ingest_port, [gw.proc.pid], *load))
                figures["redis_cpu_s"] = _cpu(redis_pid) - redis_cpu0
                print(f"{label:24} " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}))
            finally:
                gw.stop()
        a, b = Gateway(workdir / "a", redis.url), Gateway(workdir / "b", redis.url)
        try:
            figures = asyncio.run(_load([a.port], b.ingest_port, [a.proc.pid, b.proc.pid], *load))
            print(
                f"{'cross-node (sub A, pub B)':24} p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms,"
                f" {figures['deliveries_per_s']:.0f} deliveries/s"
            )
            rec = asyncio.run(_recovery(a, b, 500))
            print(
                f"{'recovery after kill -9':24} {rec['recovery_ms']:.0f} ms to reconnect to B and recover"
                f" {rec['recovered']} messages ({rec['announced_lost']} announced lost)"
            )
        finally:
            a.stop()
            b.stop()
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
