"""``fanout-loadtest chaos``: faults on a two-node cluster under load, then the invariant (docs/reliability.md).

Starts redis-server (append-only file, fsync always: a restart keeps what it accepted), or with ``--redis
sentinel`` a primary, a replica and three sentinels (loadtest/sentinelproc.py), or with ``--redis cluster`` a
Redis Cluster of three primaries and three replicas (loadtest/clusterproc.py), and two gateway nodes
on it (``--workers N``: one node with N worker processes), a faulty TCP proxy in front of each node, clients
on every transport (raw WebSocket, SSE, long-poll, fanout_client) on ring, snapshot and private topics (the
private ones on every transport, acknowledged over SSE and fanout_client), publishers on the TCP ingest and
the admin API; runs the fault schedule for ``--duration`` seconds; samples RSS and open files of every process
and Redis's memory every ``--sample`` seconds; then reads every ring once more and checks (loadtest/chaos_check.py).
Exit status 0 when nothing was violated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect as ws_connect

from loadtest.aio import within
from loadtest.chaos_check import check_all
from loadtest.chaos_clients import (
    Accepted,
    AdminPublisher,
    FaultyProxy,
    IngestPublisher,
    LibClient,
    LpClient,
    SseClient,
    WsClient,
    ws_burst,
)
from loadtest.clusterproc import ClusterTopology, key_slot
from loadtest.redisproc import RedisProcess, free_port
from loadtest.sentinelproc import SentinelTopology

ADMIN = "chaos-admin-token"
SECRET = "chaos-jwt-secret-0123456789abcdef0123456789"
FAULTS = (
    "node-kill",
    "redis-restart",
    "redis-wipe",
    "redis-stall",
    "path-delay",
    "path-cut",
    "path-stall",
    "path-lossy",
    "slow-reader",
    "storm",
    "burst",
    "takeover",
    "crowd",
)
#: the faults of a Sentinel run (`--redis sentinel`): the single Redis's faults give way to the primary's
#: kill -9, its replica promoted by the sentinels (the killed process comes back as the new replica)
SENTINEL_FAULTS = (
    "node-kill",
    "primary-kill",
    "path-delay",
    "path-cut",
    "path-stall",
    "path-lossy",
    "slow-reader",
    "storm",
    "burst",
    "takeover",
    "crowd",
)
#: the faults of a Redis Cluster run (`--redis cluster`): the primary of the shard holding the first ring topic
#: killed -9 (its replica promoted by the cluster; the killed process comes back as its replica), and that
#: topic's slot moved to another primary under load
CLUSTER_FAULTS = (
    "node-kill",
    "shard-kill",
    "slot-move",
    "path-delay",
    "path-cut",
    "path-stall",
    "path-lossy",
    "slow-reader",
    "storm",
    "burst",
    "takeover",
    "crowd",
)
#: how long a `primary-kill` waits for the sentinels to name the replica primary
PROMOTION_MAX_S = 30.0
#: Sentinel's primary and replica: a replica syncs at once, not after diskless sync's default 5 s (as the
#: cluster's nodes, loadtest/clusterproc.py): the start waits less, and a killed primary's replica is in sync
SYNC_AT_ONCE = ("--repl-diskless-sync-delay", "0")
RING = ["chaos.ring.0", "chaos.ring.1"]
SNAP = "chaos.snap"
PRIVATE = "private.chaos"


class Node:
    """One `python -m gateway serve` on fixed ports (a restart comes back where clients look for it)."""

    def __init__(self, name: str, workdir: Path, broker: str, workers: int = 1) -> None:
        self.name = name
        self.workers = workers
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port, self.ingest_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        (self.dir / "gateway.toml").write_text(f"""[server]
host = "127.0.0.1"
port = {self.port}
admin_token = "{ADMIN}"
log_level = "warning"
max_connections_per_ip = 0
workers = {workers}
drain_timeout_s = 2.0  # a run's end: no client waits to be handed over
[websocket]
blocked_timeout_s = 4.0
[longpoll]
max_sessions_per_ip = 0
poll_timeout_s = 5.0
[sse]
max_sessions_per_ip = 0
heartbeat_s = 2.0
[ingest]
port = {self.ingest_port}
[rawtcp]
enabled = false
[auth]
jwt_secret = "{SECRET}"
rate_per_ip = 1000.0
burst_per_ip = 1000
[limits]
publish_rate = 20.0
publish_burst = 20
topic_create_rate = 100.0
[broker]
{broker}
connect_timeout_s = 20.0
[[topics.rules]]
pattern = "private.*"
kind = "private"
max_count = 256
[[topics.rules]]
pattern = "chaos.snap*"
kind = "snapshot"
anonymous = true
[[topics.rules]]
pattern = "*"
kind = "ring"
capacity = 256
anonymous = true
client_publish = true
""")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        ready = self.dir / "ready.json"
        ready.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(self.dir / "gateway.toml"), "--ready-file", str(ready)],
            env={**env, "PYTHONSAFEPATH": "1"},
            stdout=open(self.dir / "gateway.log", "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 40
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {self.name} did not start: {self.log()[-2000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        path = self.dir / "gateway.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill9(self) -> None:
        workers = self.worker_pids()  # they outlive a -9 of their supervisor
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def worker_pids(self) -> list[int]:
        """The supervisor's worker processes (``server.workers`` > 1), or none."""
        if self.proc is None or self.workers < 2:
            return []
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


async def event_loop_tasks(http: httpx.AsyncClient, port: int) -> int | None:
    """`fanout_event_loop_tasks` of the gateway on `port` (with workers: of the one that answers)."""
    try:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("fanout_event_loop_tasks "):
            return int(float(line.split()[1]))
    return None


def proc_sample(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open file descriptors) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


@dataclass
class FaultRecord:
    name: str
    start: float
    healed: float
    detail: dict[str, Any] = field(default_factory=dict)


def token_for(user: str) -> str:
    from gateway.admin.operator_tools import mint_token
    from gateway.config import load_config

    path = Path(tempfile.mkdtemp(prefix="chaos-tok-")) / "c.toml"
    path.write_text(f'[auth]\njwt_secret = "{SECRET}"\n')
    try:
        return mint_token(load_config(str(path)), user, subscribe=["*"], publish=["*"], ttl=86400)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


class Chaos:
    def __init__(
        self,
        workdir: Path,
        duration: float,
        faults: list[str],
        seed: int,
        sample_s: float,
        warmup: float,
        workers: int = 1,
        pause: tuple[float, float] = (6.0, 9.0),
        settle_s: float | None = None,
        rounds: int | None = None,
        tail_s: float = 14.0,
        idle_samples: int = 0,
        redis: str = "single",
        slow_reader_s: float = 8.0,
    ) -> None:
        self.workdir = workdir
        self.workers = workers
        self.duration = duration
        self.faults = faults
        #: seconds between a fault's end (or, with `settle_s`, every client served again) and the next fault
        self.pause = pause
        #: wait until every client got a message published after the fault's end (at most this long), then pause
        self.settle_s = settle_s
        #: run the fault list this many times, then `tail_s` s more traffic and the end (not later than `duration`)
        self.rounds = rounds
        self.tail_s = tail_s
        #: samples taken 1 s apart once every client left (the growth's last ones: what is left over)
        self.idle_samples = idle_samples
        #: how long the slow reader stops reading (past `blocked_timeout_s` 4)
        self.slow_reader_s = slow_reader_s
        self.rng = random.Random(seed)
        self.sample_s = sample_s
        self.warmup = warmup
        #: `--redis sentinel`: the topology, whose primary is `redis` (it changes with each `primary-kill`)
        self.topology = SentinelTopology(workdir / "sentinel") if redis == "sentinel" else None
        if self.topology is not None:
            for process in (self.topology.primary, self.topology.replica):
                process.extra = (*process.extra, *SYNC_AT_ONCE)
        #: `--redis cluster`: the Redis Cluster (`redis` is one of its nodes, sampled for memory)
        self.cluster = ClusterTopology(workdir / "cluster") if redis == "cluster" else None
        self.redis = (
            self.topology.primary
            if self.topology
            else self.cluster.nodes[0]
            if self.cluster
            else RedisProcess(workdir / "redis", appendonly=True)
        )
        self.nodes: list[Node] = []
        #: each shared topic's epoch and range on each node at the end (`node_views`)
        self.views: dict[str, dict[str, Any]] = {}
        self.proxies: list[FaultyProxy] = []
        self.acc = Accepted()
        self.fault_log: list[FaultRecord] = []
        self.samples: list[dict[str, Any]] = []
        self.wipes: list[float] = []
        self.t0 = 0.0
        #: the records of the streams a violation names (written to violating-records.json)
        self.violating: dict[str, list[dict[str, Any]]] = {}

    def say(self, text: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {text}", flush=True)

    async def run(self) -> dict[str, Any]:
        self.t0 = time.time()
        if self.topology is not None:
            await asyncio.to_thread(self.topology.start)
            broker = (
                f"sentinel_addresses = {json.dumps(self.topology.addresses)}\n"
                f'sentinel_master = "{self.topology.broker_section()["sentinel_master"]}"'
            )
        elif self.cluster is not None:
            await asyncio.to_thread(self.cluster.start)
            broker = f"cluster_addresses = {json.dumps(self.cluster.addresses)}"
        else:
            self.redis.start()
            broker = f'url = "{self.redis.url}"'
        if self.workers > 1:  # one node, its supervisor and workers; every client through it
            self.nodes = [Node("a", self.workdir, broker, self.workers)]
        else:
            self.nodes = [Node("a", self.workdir, broker), Node("b", self.workdir, broker)]
        await asyncio.gather(*(asyncio.to_thread(node.start) for node in self.nodes))
        self.proxies = [FaultyProxy(n.port) for n in self.nodes]
        for p in self.proxies:
            await p.start()
        pa, pb = self.proxies[0].url, self.proxies[-1].url
        shared = [*RING, SNAP]
        tok = {u: token_for(u) for u in ("u0", "u1", "u2", "u3")}
        self.clients: list[Any] = [
            WsClient("ws-a1", [pa, pb], shared),
            WsClient("ws-b1", [pb, pa], shared),
            WsClient("ws-slow", [pa, pb], shared),
            WsClient("priv-u0-a", [pa, pb], [*shared, PRIVATE], token=tok["u0"], user="u0", private=(PRIVATE,)),
            WsClient("priv-u0-b", [pb, pa], [*shared, PRIVATE], token=tok["u0"], user="u0", private=(PRIVATE,)),
            SseClient("sse-a", [pa, pb], shared),
            SseClient("sse-b", [pb, pa], shared),
            LpClient("lp-a", [pa, pb], shared),
            LpClient("lp-b", [pb, pa], shared),
            LibClient("lib-a", pa, [*shared, PRIVATE], token=tok["u1"], user="u1"),
            # private queues over SSE (acks POSTed) and long-poll (acknowledged by the next poll)
            SseClient("sse-priv-u2", [pb, pa], shared, token=tok["u2"], user="u2", private=(PRIVATE,)),
            LpClient("lp-priv-u3", [pa, pb], [*shared, PRIVATE], token=tok["u3"], user="u3", private=(PRIVATE,)),
        ]
        self.clients[4].holds.clear()  # u0's second connection waits for its turn (the takeover fault)
        tasks = [asyncio.create_task(c.run()) for c in self.clients]
        await self.subscribed(20.0)  # subscriptions (and private queues) exist before the publishers start
        ingest = IngestPublisher("ingest", [n.ingest_port for n in self.nodes], RING, 60.0, self.acc)
        admin = AdminPublisher(
            "admin",
            [n.url for n in self.nodes],
            ADMIN,
            RING[:1],
            [SNAP],
            [(u, PRIVATE) for u in ("u0", "u1", "u2", "u3")],
            5.0,
            self.acc,
        )
        publishers: list[Any] = [ingest, admin]
        ptasks = [asyncio.create_task(p.run()) for p in publishers]
        sampler = asyncio.create_task(self.sample_loop())
        end = time.monotonic() + self.duration
        self.say(f"warm-up {self.warmup:g} s; {len(self.clients)} clients, faults: {', '.join(self.faults)}")
        await asyncio.sleep(self.warmup)
        i = 0
        last = None if self.rounds is None else self.rounds * len(self.faults)
        while self.faults and time.monotonic() < end - 20 and (last is None or i < last):
            name = self.faults[i % len(self.faults)]
            i += 1
            start = time.time()
            self.say(f"fault {name}")
            detail = await self.inject(name) or {}
            # a fault the system heals itself (a primary's kill) counts from its moment, not its injection's end
            record = FaultRecord(name, start, detail.pop("healed_at", None) or time.time(), detail)
            self.fault_log.append(record)
            if self.settle_s is not None:
                await self.settle(record, self.settle_s)
            await asyncio.sleep(min(max(0.0, end - 20 - time.monotonic()), self.rng.uniform(*self.pause)))
        if last is not None:  # the rounds ran: `tail_s` more seconds of traffic, then the end
            end = min(end, time.monotonic() + self.tail_s + 6)
        await asyncio.sleep(max(0.0, end - 6 - time.monotonic()))
        for p in publishers:
            p.stop_event.set()
        await asyncio.gather(*ptasks, return_exceptions=True)
        self.say("publishers stopped")
        await self.quiet(1.5, 5.0)  # the last deliveries, long-polls included
        rings = {t: await self.read_ring(t) for t in RING}
        self.views = await self.node_views()
        self.say("rings read")
        for c in self.clients:
            c.stop_event.set()
            if isinstance(c, WsClient) and c.ws is not None:
                await c.ws.close()
        # a long-poll or SSE read waits for its poll timeout or heartbeat: nothing comes any more (the
        # publishers stopped 5 s ago), so a client still reading after 1 s is cancelled there
        _, reading = await asyncio.wait(tasks, timeout=1.0)
        for task in reading:
            task.cancel()
        await asyncio.wait(tasks, timeout=20)
        self.say("clients ended")
        sampler.cancel()
        if self.idle_samples:
            async with httpx.AsyncClient(timeout=2.0) as http:
                for _ in range(self.idle_samples):
                    await asyncio.sleep(1.0)
                    await self.sample(http)
        for p in self.proxies:
            await p.close()
        return self.finish(rings)

    async def subscribed(self, bound: float) -> None:
        """Until every client's subscriptions were answered (at most `bound` seconds; then on regardless)."""
        deadline = time.monotonic() + bound
        waiting = list(self.clients)
        while waiting and time.monotonic() < deadline:
            waiting = [c for c in waiting if not c.subscribed()]
            if waiting:
                await asyncio.sleep(0.05)
        self.say(
            f"not subscribed after {bound:g} s: {', '.join(c.name for c in waiting)}"
            if waiting
            else f"every client subscribed in {time.monotonic() - deadline + bound:.1f} s"
        )

    async def quiet(self, quiet_s: float, bound: float) -> None:
        """Until no client recorded anything for `quiet_s` seconds, at most `bound` seconds."""
        start = changed = time.monotonic()
        count = -1
        while time.monotonic() - changed < quiet_s and time.monotonic() - start < bound:
            now = sum(len(events) for c in self.clients for events in c.rec.events.values())
            if now != count:
                count, changed = now, time.monotonic()
            await asyncio.sleep(0.05)

    async def settle(self, fault: FaultRecord, bound: float) -> None:
        """Until every client got a message published after the fault's end (what `recovery` counts), at most
        `bound` seconds: a client still unserved then is left for the check to report."""
        deadline = time.monotonic() + bound
        waiting = list(self.clients)
        while waiting and time.monotonic() < deadline:
            waiting = [c for c in waiting if not served_since(c, fault)]
            if waiting:
                await asyncio.sleep(0.05)
        self.say(
            f"  {fault.name}: every client served again"
            if not waiting
            else f"  {fault.name}: not served again after {bound:g} s: {', '.join(c.name for c in waiting)}"
        )

    async def sample_loop(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                await self.sample(http)
                await asyncio.sleep(self.sample_s)

    async def sample(self, http: httpx.AsyncClient) -> None:
        """One row: RSS and descriptors of every process, each node's asyncio tasks (its /metrics), Redis's memory."""
        row: dict[str, Any] = {"t": time.time()}
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                got = proc_sample(node.proc.pid)
                if got:
                    row[f"node-{node.name}"] = {
                        "pid": node.proc.pid,
                        "rss": got[0],
                        "fds": got[1],
                        "tasks": await event_loop_tasks(http, node.port),
                    }
                for i, pid in enumerate(sorted(node.worker_pids())):
                    got = proc_sample(pid)
                    if got:
                        row[f"node-{node.name}-w{i}"] = {"pid": pid, "rss": got[0], "fds": got[1]}
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            got = proc_sample(self.redis.proc.pid)
            mem = await asyncio.to_thread(self.redis.used_memory)
            if got:
                row["redis"] = {"pid": self.redis.proc.pid, "rss": got[0], "fds": got[1], "used_memory": mem}
        self.samples.append(row)

    async def inject(self, name: str) -> dict[str, Any] | None:
        b = self.nodes[-1]
        pa = self.proxies[0]
        if name == "node-kill" and self.workers > 1:
            return await self.kill_worker(b)
        if name == "node-kill":
            b.kill9()
            await asyncio.sleep(1.5)
            await asyncio.to_thread(b.start)
        elif name == "redis-stall":
            self.redis.stall(True)
            await asyncio.sleep(3.0)
            self.redis.stall(False)
        elif name == "path-lossy":
            resets = 0
            for _ in range(6):  # every second, 30% of the connections on every path reset
                resets += sum(p.reset_share(0.3, self.rng) for p in self.proxies)
                await asyncio.sleep(1.0)
            return {"resets": resets}
        elif name in ("redis-restart", "redis-wipe"):
            wipe = name == "redis-wipe"
            if wipe:
                self.wipes.append(time.time())
            self.redis.stop(wipe=wipe)
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.redis.start)
        elif name == "primary-kill":
            return await self.kill_primary()
        elif name == "shard-kill":
            return await self.kill_shard()
        elif name == "slot-move":
            return await self.move_slot()
        elif name == "path-delay":
            pa.delay = 0.3
            await asyncio.sleep(6.0)
            pa.delay = 0.0
        elif name == "path-cut":
            pa.cut(2.0)
            await asyncio.sleep(2.0)
        elif name == "path-stall":
            pa.stalled = True
            await asyncio.sleep(5.0)
            pa.stalled = False
        elif name == "slow-reader":
            slow = next(c for c in self.clients if c.name == "ws-slow")
            slow.stall_until = time.monotonic() + self.slow_reader_s
            await asyncio.sleep(self.slow_reader_s)
        elif name == "storm":
            for c in self.clients:
                if isinstance(c, LibClient):
                    if c.client is not None and c.client._ws is not None:
                        await c.client._ws.close()
                else:
                    c.kick.set()
                    if isinstance(c, WsClient) and c.ws is not None:
                        await c.ws.close()
        elif name == "burst":
            answers = await ws_burst(self.nodes[0].url, RING[1], 300, self.acc)
            async with httpx.AsyncClient(timeout=15, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
                base = 1_000_000 + len(self.fault_log) * 1000
                msgs = [{"p": "burst-admin", "n": base + k, "t": time.time()} for k in range(200)]
                reply = await http.post(
                    f"{self.nodes[0].url}/api/topics/{RING[1]}/publish", content=orjson.dumps({"messages": msgs})
                )
                if reply.status_code == 200:
                    self.acc.ring[RING[1]]["burst-admin"].extend(base + k for k in range(200))
            return {"ws_answers": answers, "admin_status": reply.status_code}
        elif name == "takeover":
            a, b2 = (c for c in self.clients if c.name.startswith("priv-u0"))
            taker = b2 if PRIVATE in a.holds else a
            taker.take_over()
            return {"taker": taker.name}
        elif name == "crowd":

            async def one() -> None:
                try:
                    async with ws_connect(
                        self.nodes[0].url.replace("http", "ws") + "/ws", compression=None, open_timeout=5
                    ) as ws:
                        await ws.send(orjson.dumps({"op": "subscribe", "topic": RING[0]}).decode())
                        await asyncio.sleep(3.0)
                except OSError:
                    pass

            await asyncio.gather(*(one() for _ in range(100)))
        return None

    async def kill_primary(self) -> dict[str, Any]:
        """kill -9 the primary; the sentinels promote the replica; the killed process comes back as the new
        primary's replica. A replica lags: what it lacked is announced per topic (`epoch` loss); private
        queues' last accepted messages may go as in a wipe (docs/cluster.md §8), so the kill counts as one."""
        topology = self.topology
        assert topology is not None
        killed, killed_at = time.monotonic(), time.time()
        self.wipes.append(killed_at)
        victim = await asyncio.to_thread(topology.kill_primary)
        survivor = topology.replica if victim is topology.primary else topology.primary
        accepted = asyncio.create_task(self.accepted_again(killed))
        while not await asyncio.to_thread(topology.promoted, survivor.port):
            if time.monotonic() - killed > PROMOTION_MAX_S:
                accepted.cancel()
                return {"promoted": False, "healed_at": killed_at}
            await asyncio.sleep(0.05)
        promoted_s = time.monotonic() - killed
        self.redis = survivor
        accepted_s = await accepted
        victim.extra = ("--replicaof", "127.0.0.1", str(survivor.port), *SYNC_AT_ONCE)
        await asyncio.to_thread(victim.start)
        # healed once a next kill could be failed over: every sentinel sees the victim back as a linked
        # replica (a kill before that found no replica to promote)
        while not await asyncio.to_thread(topology.replica_ready, victim.port):
            if time.monotonic() - killed > PROMOTION_MAX_S:
                return {
                    "promoted": True,
                    "promoted_s": round(promoted_s, 2),
                    "accepted_s": accepted_s,
                    "replica_ready": False,
                    "healed_at": killed_at,
                }
            await asyncio.sleep(0.1)
        return {"promoted": True, "promoted_s": round(promoted_s, 2), "accepted_s": accepted_s, "healed_at": killed_at}

    def ring_slot(self) -> int:
        return key_slot(f"fanout:{{{RING[0]}}}:c")

    async def kill_shard(self) -> dict[str, Any]:
        """kill -9 the primary of the first ring topic's shard; the cluster promotes its replica; the killed
        process comes back as that replica. As on Sentinel, a kill counts as a wipe for private queues."""
        cluster = self.cluster
        assert cluster is not None
        victim = await asyncio.to_thread(cluster.primary_of, self.ring_slot())
        killed, killed_at = time.monotonic(), time.time()
        self.wipes.append(killed_at)
        cluster.kill(victim)
        accepted = asyncio.create_task(self.accepted_again(killed))
        try:
            await asyncio.to_thread(cluster.wait_promoted, self.ring_slot(), victim, PROMOTION_MAX_S)
        except RuntimeError:
            accepted.cancel()
            return {"promoted": False, "healed_at": killed_at}
        promoted_s = time.monotonic() - killed
        accepted_s = await accepted
        served_s = await self.served_on(RING[0], killed_at)
        await asyncio.to_thread(victim.start)  # its nodes.conf: it rejoins, as the new primary's replica
        return {
            "promoted": True,
            "promoted_s": round(promoted_s, 2),
            "accepted_s": accepted_s,
            "served_s": served_s,
            "healed_at": killed_at,
        }

    async def served_on(self, topic: str, since: float) -> float | None:
        """Seconds from `since` (wall clock) until every client got a message of `topic` published after it
        (the killed shard's topic: its messages flow again only after the failover); None: not within 15 s."""
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            firsts = [
                next(
                    (
                        e["t"]
                        for e in c.rec.events.get(topic, [])
                        if e["ev"] == "msg" and isinstance(e["data"], dict) and e["data"].get("t", 0) >= since
                    ),
                    None,
                )
                for c in self.clients
            ]
            if all(t is not None for t in firsts):
                return round(max(t for t in firsts if t is not None) - since, 2)
            await asyncio.sleep(0.1)
        return None

    async def move_slot(self) -> dict[str, Any]:
        """Move the first ring topic's slot to another primary under load (as `redis-cli --cluster reshard`)."""
        cluster = self.cluster
        assert cluster is not None
        slot = self.ring_slot()
        source = await asyncio.to_thread(cluster.primary_of, slot)
        target = next(p for p in await asyncio.to_thread(cluster.primaries) if p is not source)
        t0 = time.monotonic()
        keys = await asyncio.to_thread(cluster.move_slot, slot, target)
        return {"slot": slot, "keys": keys, "from": source.port, "to": target.port, "moved_s": round(time.monotonic() - t0, 2)}

    async def accepted_again(self, since: float) -> float | None:
        """Seconds from `since` (monotonic) until an admin publish is accepted again (None: not within
        PROMOTION_MAX_S)."""
        async with httpx.AsyncClient(timeout=5.0, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            while time.monotonic() - since < PROMOTION_MAX_S:
                try:
                    reply = await http.post(
                        f"{self.nodes[0].url}/api/topics/chaos.probe/publish",
                        content=orjson.dumps({"data": {"probe": time.time()}}),
                    )
                    if reply.status_code == 200:
                        return round(time.monotonic() - since, 2)
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        return None

    async def kill_worker(self, node: Node) -> dict[str, Any]:
        """``--workers``: one worker -9. The supervisor forks it again (docs/cluster.md §5, "Workers survive each
        other") while its siblings serve on: the fault waits for the new process among the supervisor's children."""
        workers = node.worker_pids()
        if not workers or node.proc is None:
            return {"error": "no worker"}
        victim = self.rng.choice(workers)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            now = node.worker_pids()
            if victim not in now and len(now) == len(workers):
                return {"killed": victim, "of": len(workers), "forked_again_s": round(time.monotonic() - t0, 2)}
            await asyncio.sleep(0.05)
        node.kill9()  # not forked again in time: the node is started again whole, as a supervisor above it would
        await asyncio.sleep(1.5)
        await asyncio.to_thread(node.start)
        return {"killed": victim, "of": len(workers), "forked_again_s": None}

    async def node_views(self) -> dict[str, dict[str, Any]]:
        """Each shared topic as each node sees it at the end: its epoch and where it stands (ring: the end of
        its range, the next seq; snapshot: the latest seq). With a broker the nodes must agree (docs/cluster.md;
        the start of a node's range is its own: a node that came back holds what it read since)."""
        views: dict[str, dict[str, Any]] = {}
        async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            for topic in [*RING, SNAP]:
                for node in self.nodes:
                    info = (await http.get(f"{node.url}/api/topics/{topic}")).json()
                    views.setdefault(topic, {})[node.name] = [info.get("epoch"), info.get("end", info.get("seq"))]
        return views

    async def read_ring(self, topic: str) -> list[dict[str, Any]]:
        """The topic's retained messages now: its range from the admin API, then a subscribe from its start."""
        node = self.nodes[0]
        async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            info = (await http.get(f"{node.url}/api/topics/{topic}")).json()
        epoch, end = info["epoch"], int(info["end"])
        got: list[dict[str, Any]] = []
        async with ws_connect(node.url.replace("http", "ws") + "/ws", max_size=None, compression=None) as ws:
            await ws.send(orjson.dumps({"op": "subscribe", "topic": topic, "since": {"epoch": epoch, "seq": 0}}).decode())
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and (not got or got[-1]["seq"] < end - 1):
                for e in orjson.loads(await within(ws.recv(), 15)):
                    if e.get("type") == "msg" and e.get("topic") == topic:
                        got.append({"ev": "msg", "seq": e["seq"], "data": e["data"]})
        return got

    def finish(self, rings: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        kinds = {t: "ring" for t in RING} | {SNAP: "snapshot", PRIVATE: "private"}
        records = {c.name: dict(c.rec.events) for c in self.clients}
        users = {c.name: c.rec.user for c in self.clients if c.rec.user}
        result = check_all(
            records,
            kinds,
            users,
            dict(self.acc.private),
            rings,
            {t: dict(v) for t, v in self.acc.ring.items()},
            self.wipes,
            {t: dict(v) for t, v in self.acc.unknown.items()},
        )
        bad = {(v.client, v.topic) for v in result.violations}
        bad_users = {v.client for v in result.violations if v.kind.startswith("private")}
        self.violating = {
            f"{c}/{t}": ev
            for c, ts in records.items()
            for t, ev in ts.items()
            if (c, t) in bad or (users.get(c) in bad_users and kinds.get(t) == "private")
        }
        self.violating["accepted"] = [
            {"user": u, "topic": t, "accepted": v} for (u, t), v in self.acc.private.items() if u in bad_users
        ]
        return {
            "duration_s": self.duration,
            "faults": [f.__dict__ for f in self.fault_log],
            "check": result.as_json(),
            # each shared topic's [epoch, end or seq] by node, and the topics on which they differ
            "views": self.views,
            "disagree": sorted(t for t, by_node in self.views.items() if len({str(v) for v in by_node.values()}) > 1),
            "recovery": recovery(self.fault_log, self.clients),
            "clients": {
                c.name: {"transport": c.rec.transport, "connects": c.rec.connects, "closes": close_counts(c.rec.closes)}
                for c in self.clients
            },
            "published": {
                "ring_accepted": {t: {p: len(ns) for p, ns in v.items()} for t, v in self.acc.ring.items()},
                "private_accepted": {f"{u}/{t}": len(v) for (u, t), v in self.acc.private.items()},
                "refused": dict(self.acc.refused),
                "uncertain": dict(self.acc.uncertain),
            },
            "growth": growth(self.samples, self.warmup),
            "samples": self.samples,
            "logs": scan_logs([n.dir / "gateway.log" for n in self.nodes]),
            "ring_sizes": {t: len(r) for t, r in rings.items()},
        }


def close_counts(closes: list[tuple[float, int, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, code, reason in closes:
        key = f"{code} {reason}".strip()
        out[key] = out.get(key, 0) + 1
    return out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def served_since(client: Any, fault: FaultRecord) -> bool:
    """Whether the client received, since the fault started, a message published after its end on a topic
    other than the private one (the event `recovery` takes as the client's recovery)."""
    for topic, events in client.rec.events.items():
        if topic == PRIVATE:
            continue
        for e in reversed(events):
            if e.get("t", 0.0) < fault.start:
                break
            if e["ev"] == "msg" and isinstance(e["data"], dict) and e["data"].get("t", 0) >= fault.healed:
                return True
    return False


def recovery(faults: list[FaultRecord], clients: list[Any]) -> dict[str, Any]:
    """Per fault: for each client, the time from the fault's end to the first message published after it
    that reached the client; loss notices and closes in the fault's window (until the next fault)."""
    per: dict[str, dict[str, Any]] = {}
    for i, f in enumerate(faults):
        window_end = faults[i + 1].start if i + 1 < len(faults) else float("inf")
        entry = per.setdefault(
            f.name, {"times": [], "unserved": 0, "losses": {}, "lost_seqs": 0, "closes": {}, "count": 0, "duration_s": []}
        )
        entry["count"] += 1
        entry["duration_s"].append(f.healed - f.start)
        for c in clients:
            first = None
            for topic, events in c.rec.events.items():
                for e in events:
                    t = e.get("t", 0.0)
                    if not (f.start <= t < window_end):
                        continue
                    if (
                        e["ev"] == "msg"
                        and topic != PRIVATE
                        and isinstance(e["data"], dict)
                        and e["data"].get("t", 0) >= f.healed
                    ):
                        first = t if first is None else min(first, t)
                        break
                    if e["ev"] == "loss":
                        entry["losses"][e["reason"]] = entry["losses"].get(e["reason"], 0) + 1
                        if e["to"] is not None:
                            entry["lost_seqs"] += e["to"] - e["from"]
            if first is None:
                entry["unserved"] += 1
            else:
                entry["times"].append(max(0.0, first - f.healed))
            for t, code, reason in c.rec.closes:
                if f.start <= t < window_end:
                    key = f"{code} {reason}".strip()
                    entry["closes"][key] = entry["closes"].get(key, 0) + 1
    out = {}
    for name, e in per.items():
        times = e.pop("times")
        e["duration_s"] = round(statistics.mean(e["duration_s"]), 2)
        e["recovery_s"] = (
            {"p50": round(_pct(times, 0.5), 3), "p99": round(_pct(times, 0.99), 3), "max": round(max(times), 3), "n": len(times)}
            if times
            else None
        )
        out[name] = e
    return out


def growth(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    """Per process (name and pid: a restarted node is another process): RSS and descriptors at the first
    samples after the warm-up and at the last ones (means of 3), and the change in percent. A process started
    during the run (a restarted node or Redis) has its own warm-up: its first `warmup` seconds are left out
    (a sample taken while it was still starting, or its clients still coming back, is no baseline)."""
    if not samples:
        return {}
    series: dict[str, list[dict[str, Any]]] = {}
    for row in samples:
        for key, val in row.items():
            if key != "t":
                series.setdefault(f"{key} pid {val['pid']}", []).append({**val, "t": row["t"]})
    out = {}
    for key, rows in series.items():
        rows = [r for r in rows if r["t"] >= rows[0]["t"] + warmup]
        if len(rows) < 6:
            continue
        first, last = rows[:3], rows[-3:]
        entry: dict[str, Any] = {"samples": len(rows), "span_s": round(rows[-1]["t"] - rows[0]["t"], 1)}
        for metric in ("rss", "fds", "tasks", "used_memory"):
            a = [r[metric] for r in first if r.get(metric) is not None]
            b = [r[metric] for r in last if r.get(metric) is not None]
            if a and b:
                ma, mb = statistics.mean(a), statistics.mean(b)
                entry[metric] = {"start": round(ma), "end": round(mb), "growth_pct": round((mb - ma) / ma * 100, 1)}
        out[key] = entry
    return out


def scan_logs(paths: list[Path]) -> dict[str, Any]:
    """Tracebacks and ERROR lines in the gateways' logs (CRITICAL too)."""
    found: list[str] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if "Traceback" in line or " ERROR " in line or " CRITICAL " in line:
                found.append(f"{path.parent.name}: {line[:300]}")
    return {"bad_lines": len(found), "first": found[:20]}


def report(result: dict[str, Any]) -> str:
    lines = []
    check = result["check"]
    lines.append(f"violations: {len(check['violations'])}")
    for v in check["violations"][:50]:
        lines.append(f"  {v['kind']}: client {v['client']} topic {v['topic']} [{v['from_seq']}, {v['to_seq']}) {v['detail']}")
    if check["expected_losses"]:
        lines.append(f"expected (documented) losses: {len(check['expected_losses'])}")
    lines.append("recovery per fault (s from the fault's end to a message published after it, per client):")
    lines.append(
        f"  {'fault':14} {'n':>2} {'lasts':>6} {'p50':>7} {'p99':>7} {'max':>7} {'unserved':>8}  loss notices (seqs)  closes"
    )
    for name, e in result["recovery"].items():
        r = e["recovery_s"] or {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
        losses = ", ".join(f"{k} {v}" for k, v in sorted(e["losses"].items())) or "-"
        closes = ", ".join(f"{k}: {v}" for k, v in sorted(e["closes"].items())) or "-"
        lines.append(
            f"  {name:14} {e['count']:>2} {e['duration_s']:>6.1f} {r['p50']:>7.3f} {r['p99']:>7.3f} "
            f"{r['max']:>7.3f} {e['unserved']:>8}  {losses} ({e['lost_seqs']})  {closes}"
        )
    lines.append("growth after warm-up (first vs last samples):")
    for key, g in result["growth"].items():
        parts = [
            f"{m} {g[m]['start']}->{g[m]['end']} ({g[m]['growth_pct']:+.1f}%)"
            for m in ("rss", "fds", "tasks", "used_memory")
            if m in g
        ]
        lines.append(f"  {key:24} {g['span_s']:>6.0f} s  " + ", ".join(parts))
    lines.append(f"log lines with a traceback or ERROR: {result['logs']['bad_lines']}")
    for line in result["logs"]["first"][:10]:
        lines.append(f"  {line}")
    pub = result["published"]
    lines.append(
        f"published: ring {pub['ring_accepted']}, private {pub['private_accepted']}, refused "
        f"{pub['refused']}, uncertain {pub['uncertain']}"
    )
    return "\n".join(lines)


def parse_faults(text: str, known: tuple[str, ...] = FAULTS) -> list[str]:
    if text in ("all", ""):
        return list(known) if text == "all" else []
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown faults {unknown}; known: {', '.join(known)}")
    return names


def run(
    duration: float,
    faults: list[str],
    out: Path | None,
    seed: int,
    sample_s: float = 5.0,
    warmup: float | None = None,
    keep: bool = False,
    workers: int = 1,
    pause: tuple[float, float] = (6.0, 9.0),
    settle_s: float | None = None,
    rounds: int | None = None,
    tail_s: float = 14.0,
    idle_samples: int = 0,
    redis: str = "single",
    slow_reader_s: float = 8.0,
) -> dict[str, Any]:
    """`duration` bounds the run; with `rounds` it ends once the fault list ran that many times (and `tail_s`
    seconds of traffic after). `settle_s`: after each fault, wait until every client is served again (at most
    that long) before the `pause` (seconds, drawn between the two bounds). `idle_samples`: samples taken 1 s
    apart once every client left, the last ones of the growth figures (what the run left behind).
    `slow_reader_s`: how long the `slow-reader` fault's client stops reading."""
    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    warm = warmup if warmup is not None else min(60.0, max(10.0, duration * 0.15))
    chaos = Chaos(
        workdir,
        duration,
        faults,
        seed,
        sample_s,
        warm,
        workers,
        pause,
        settle_s,
        rounds,
        tail_s,
        idle_samples,
        redis,
        slow_reader_s,
    )
    try:
        result = asyncio.run(chaos.run())
    finally:
        with ThreadPoolExecutor() as pool:  # each waits for its node's drain: side by side
            list(pool.map(Node.stop, chaos.nodes))
        if chaos.topology is not None:
            chaos.topology.stop()
        elif chaos.cluster is not None:
            chaos.cluster.stop()
        else:
            chaos.redis.stop()
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            for node in chaos.nodes:
                if (node.dir / "gateway.log").exists():
                    shutil.copy(node.dir / "gateway.log", out / f"gateway-{node.name}.log")
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    result["seed"] = seed
    result["workers"] = workers
    result["run_s"] = round(time.time() - chaos.t0, 1)
    if out is not None:
        (out / "chaos.json").write_text(json.dumps(result, indent=1, default=str))
        if result["check"]["violations"]:
            (out / "violating-records.json").write_text(json.dumps(chaos.violating, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fanout-loadtest chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds (default 1800: the soak)")
    parser.add_argument(
        "--faults",
        default="all",
        help=f"comma-separated, in turn (default all: {','.join(FAULTS)}; with --redis sentinel:"
        f" {','.join(SENTINEL_FAULTS)}; with --redis cluster: {','.join(CLUSTER_FAULTS)}); '' for"
        " none",
    )
    parser.add_argument("--out", type=Path, help="results directory (default results/chaos-TIME)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the pauses between faults")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between RSS / fd / Redis samples")
    parser.add_argument(
        "--warmup", type=float, help="seconds before faults and growth counting (default 15%% of the duration, 10 to 60)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="N > 1: one node with server.workers = N instead of two nodes (node-kill: one worker -9)",
    )
    parser.add_argument(
        "--redis",
        choices=("single", "sentinel", "cluster"),
        default="single",
        help="one redis-server (default), a primary, a replica and three sentinels, or a Redis"
        " Cluster of three primaries and three replicas",
    )
    args = parser.parse_args(argv)
    try:
        known = {"sentinel": SENTINEL_FAULTS, "cluster": CLUSTER_FAULTS}.get(args.redis, FAULTS)
        faults = parse_faults(args.faults, known)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if not (shutil.which("redis-server") or os.path.exists("/usr/bin/redis-server")):
        print("redis-server is missing (make redis installs it)", file=sys.stderr)
        return 2
    out = args.out or Path("results") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run(args.duration, faults, out, args.seed, args.sample, args.warmup, workers=args.workers, redis=args.redis)
    print(report(result))
    print(f"written: {out / 'chaos.json'}")
    return 1 if result["check"]["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
