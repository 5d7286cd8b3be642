"""``python -m loadtest idle-memory``: what an idle WebSocket client costs the gateway, and whether the
memory comes back when the clients leave.

One gateway subprocess on the shipped defaults (only the connection limits raised, since every client
comes from this machine). Its resident set is read from /proc before, with N connected clients each
subscribed to one of 100 quiet topics, and after they all closed, until it settles. With `--crowds K` the
crowd comes and leaves K times in turn: whether what one crowd left behind is reused by the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.aio import within
from loadtest.gatewayproc import GatewayProcess
from loadtest.procstat import raise_nofile_limit, read_stat
from loadtest.target import Target
from loadtest.wsclient import WsClient, connect

#: connections opened at once: enough to be quick, few enough not to overflow the listen backlog
CONNECT_WAVE = 200
TOPICS = 100


class Subscriber:
    """Counts its `subscribed` acknowledgement; nothing else arrives on a quiet topic."""

    def __init__(self, acked: asyncio.Event, counter: list[int], total: int) -> None:
        self.acked, self.counter, self.total = acked, counter, total

    def ws_open(self) -> None:
        pass

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
        for message in messages:
            if b'"subscribed"' in message:
                self.counter[0] += 1
                if self.counter[0] == self.total:
                    self.acked.set()

    def ws_closed(self, reason: str) -> None:
        pass


def rss(pid: int) -> int:
    stat = read_stat(pid)
    if stat is None:
        raise RuntimeError("the gateway exited")
    return stat[2]


def full_collections(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("fanout_gc_full_collections_total"):
                return int(float(line.split()[-1]))
    return 0


def websocket_clients(port: int, token: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/stats", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        stats = json.load(answer)
    return int(stats["clients"].get("websocket", 0))


async def settle(pid: int, seconds: float, period: float = 0.5) -> int:
    """The resident set after `seconds` of sampling (the gateway gives memory back on its collector's tick)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(period)
    return rss(pid)


async def crowd(target: Target, clients: int, hold_s: float, settle_s: float, compression: bool = False) -> dict[str, float]:
    """N clients connect and subscribe, stay `hold_s`, then all leave: the resident set with them, and
    `settle_s` after the last one left."""
    assert target.pid is not None and target.admin_token is not None
    acked = asyncio.Event()
    counter = [0]
    conns: list[WsClient] = []
    started = time.monotonic()
    for wave in range(0, clients, CONNECT_WAVE):
        batch = [
            connect(target.host, target.http_port, "/ws", Subscriber(acked, counter, clients), compression=compression)
            for _ in range(wave, min(clients, wave + CONNECT_WAVE))
        ]
        conns.extend(await asyncio.gather(*batch))
    for i, conn in enumerate(conns):
        conn.send_text(b'{"op":"subscribe","topic":"idle.%d"}' % (i % TOPICS))
    await within(acked.wait(), 120)
    connect_s = time.monotonic() - started
    with_clients = await settle(target.pid, hold_s)
    for conn in conns:
        conn.close()
    conns.clear()
    deadline = time.monotonic() + 60
    while websocket_clients(target.http_port, target.admin_token) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    collections = full_collections(target.http_port)
    after = await settle(target.pid, settle_s)
    return {
        "connect_s": connect_s,
        "rss_with_clients": with_clients,
        "rss_after": after,
        "full_collections_after": full_collections(target.http_port) - collections,
    }


async def measure(
    clients: int,
    settle_s: float,
    crowds: int = 1,
    hold_s: float = 5.0,
    warm_s: float = 5.0,
    gateway_cmd: str | None = None,
    compression: bool = False,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="idle-memory-"))
    with GatewayProcess(workdir, gateway_cmd, env={"GATEWAY_SERVER_MAX_CONNECTIONS": str(clients + 1000)}) as target:
        assert target.pid is not None
        await asyncio.sleep(1.0)
        before = await settle(target.pid, warm_s)
        runs = [await crowd(target, clients, hold_s, settle_s, compression) for _ in range(crowds)]
    first = runs[0]
    return {
        "clients": clients,
        "connect_s": first["connect_s"],
        "rss_before_mb": before / 2**20,
        "rss_with_clients_mb": first["rss_with_clients"] / 2**20,
        "rss_after_mb": first["rss_after"] / 2**20,
        "bytes_per_client": (first["rss_with_clients"] - before) / clients,
        "after_over_before": first["rss_after"] / before,
        "settle_s": settle_s,
        "full_collections_after": first["full_collections_after"],
        # each crowd in turn: memory a crowd left behind is reused by the next, or it grows
        "crowds": [
            {
                "rss_with_clients_mb": run["rss_with_clients"] / 2**20,
                "rss_after_mb": run["rss_after"] / 2**20,
                "after_over_before": run["rss_after"] / before,
            }
            for run in runs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest idle-memory", description=__doc__)
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait after the last client left")
    parser.add_argument("--crowds", type=int, default=1, help="crowds in turn, each N clients that come and leave")
    parser.add_argument(
        "--gateway-cmd",
        help="command that starts the gateway instead of 'python -m gateway', e.g."
        " another checkout: 'env PYTHONPATH=/path/to/checkout .venv/bin/python -m gateway'",
    )
    parser.add_argument(
        "--compression",
        choices=("off", "deflate"),
        default="off",
        help="deflate: the clients negotiate permessage-deflate, as browsers do",
    )
    args = parser.parse_args(argv)
    if args.clients < 1 or args.crowds < 1:
        parser.error("--clients and --crowds must be at least 1")
    raise_nofile_limit()
    result = asyncio.run(
        measure(args.clients, args.settle, args.crowds, gateway_cmd=args.gateway_cmd, compression=args.compression == "deflate")
    )
    print(f"{result['clients']} idle WebSocket clients (connected in {result['connect_s']:.1f} s)")
    print(
        f"  RSS before {result['rss_before_mb']:.1f} MiB, with clients {result['rss_with_clients_mb']:.1f} MiB,"
        f" after they left {result['rss_after_mb']:.1f} MiB ({result['settle_s']:g} s after the last left,"
        f" {result['full_collections_after']} full collection(s) meanwhile)"
    )
    print(f"  {result['bytes_per_client'] / 1024:.1f} KiB per idle client; after/before = {result['after_over_before']:.2f}")
    for number, run in enumerate(result["crowds"][1:], 2):
        print(
            f"  crowd {number}: RSS with clients {run['rss_with_clients_mb']:.1f} MiB, after they left"
            f" {run['rss_after_mb']:.1f} MiB; after/before = {run['after_over_before']:.2f}"
        )
    return 0
