"""How topics spread over Redis Cluster's shards, and Redis CPU per publish on 1 shard against 3 (docs/cluster.md
§10, "Figures"). Starts a cluster on loopback (loadtest/clusterproc.py) and one gateway in this process on it,
subscribes every topic on one WebSocket (so each is attached: one shard channel), publishes `--per-topic`
messages to each through the admin API, then reads from every primary its keys (DBSIZE), its shard channels
(PUBSUB SHARDCHANNELS) and its CPU (INFO cpu, before and after the publishes, less what the primaries spend
idle over as long). The topics are made by one publish each first (the admin API; a client may create only
a few), not counted.

    python -m loadtest.cluster_shards --shards 3 --topics 1000 --per-topic 20 [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect

from gateway.testing import run_gateway
from loadtest.aio import within
from loadtest.clusterproc import ClusterNodeProcess, ClusterTopology

ADMIN = "shards-admin-token"
#: seconds of idle before the publishes, whose CPU (per second) is taken off theirs
IDLE_S = 5.0


def cpu_s(node: ClusterNodeProcess) -> float:
    fields = dict(line.split(":", 1) for line in node.reply("INFO", "cpu").splitlines() if ":" in line)
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


def shape(values: list[int]) -> dict[str, float]:
    return {"max": max(values), "mean": round(statistics.mean(values), 1), "min": min(values)}


async def subscribe_all(url: str, topics: list[str]) -> Any:
    ws = await connect(url, max_size=None, compression=None)
    for topic in topics:
        await ws.send(orjson.dumps({"op": "subscribe", "topic": topic, "id": topic}).decode())
    pending = set(topics)
    while pending:
        for entry in orjson.loads(await within(ws.recv(), 30)):
            if entry.get("type") in ("subscribed", "error"):
                pending.discard(entry.get("id"))
    return ws


async def publish_all(base: str, topics: list[str], per_topic: int, concurrency: int = 16) -> int:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as http:
        sem = asyncio.Semaphore(concurrency)

        async def one(topic: str) -> int:
            async with sem:
                body = {"messages": [{"n": k} for k in range(per_topic)]}
                reply = await http.post(f"/api/topics/{topic}/publish", content=orjson.dumps(body))
                return per_topic if reply.status_code == 200 else 0

        return sum(await asyncio.gather(*(one(t) for t in topics)))


def measure(shards: int, topics: int, per_topic: int, concurrency: int = 16) -> dict[str, Any]:
    names = [f"bench.{i}" for i in range(topics)]
    with tempfile.TemporaryDirectory(prefix="shards-") as tmp:
        cluster = ClusterTopology(Path(tmp) / "cluster", shards=shards)
        cluster.start()
        try:
            with run_gateway(
                broker={"cluster_addresses": cluster.addresses},
                server={"admin_token": ADMIN},
                topics={"rules": [{"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True}]},
            ) as gw:
                base = f"http://127.0.0.1:{gw.http_port}"
                loop_result = asyncio.run(_run(base, names, per_topic, cluster, concurrency))
            primaries = cluster.primaries()
            return {
                "shards": shards,
                "topics": topics,
                "concurrency": concurrency,
                "publishes": loop_result["published"],
                "keys_per_shard": shape([int(p.command("DBSIZE").lstrip(":")) for p in primaries]),
                "channels_per_shard": shape(loop_result["channels"]),
                "redis_cpu_us_per_publish": round(loop_result["cpu"] / max(1, loop_result["published"]) * 1e6, 2),
                "publish_s": loop_result["publish_s"],
            }
        finally:
            cluster.stop()


async def _run(base: str, names: list[str], per_topic: int, cluster: ClusterTopology, concurrency: int) -> dict[str, Any]:
    await publish_all(base, names, 1)  # the admin API creates the topics (a client may create only a few)
    ws = await subscribe_all(base.replace("http", "ws") + "/ws", names)
    try:
        primaries = cluster.primaries()
        channels = [len([c for c in p.reply("PUBSUB", "SHARDCHANNELS").split("\r\n") if "{bench." in c]) for p in primaries]
        idle = sum(cpu_s(p) for p in primaries)
        await asyncio.sleep(IDLE_S)  # what the primaries spend doing nothing (cluster bus, cron, probes)
        before = sum(cpu_s(p) for p in primaries)
        idle_per_s = (before - idle) / IDLE_S
        t0 = time.monotonic()
        published = await publish_all(base, names, per_topic, concurrency)
        publish_s = round(time.monotonic() - t0, 2)
        cpu = sum(cpu_s(p) for p in primaries) - before - idle_per_s * publish_s
    finally:
        await ws.close()
    return {"channels": channels, "published": published, "cpu": cpu, "publish_s": publish_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.cluster_shards", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=3, help="primaries, one replica each (1, or 3 and more)")
    parser.add_argument("--topics", type=int, default=1000)
    parser.add_argument("--per-topic", type=int, default=20, help="publishes per topic (one admin call each topic)")
    parser.add_argument("--concurrency", type=int, default=16, help="admin calls in flight")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.shards, args.topics, args.per_topic, args.concurrency), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
