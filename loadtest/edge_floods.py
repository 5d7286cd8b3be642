"""``python -m loadtest.edge_floods headers|ws-size [--seconds S] [--root TREE]``: the HTTP-edge floods of
issue 24 against a gateway process of its own, printing the gateway's RSS (start, peak, end), its CPU time,
and the /healthz delay another client sees meanwhile (max, p99). Figures, not asserts: docs/security.md
quotes them.

* headers: 8 attacker connections each send one header value in 64 KiB writes (up to 113 MB, the
  issue's figure) until the gateway answers or closes, then reconnect, for `--seconds`;
* ws-size: 8 attacker tasks each send a `/ws` upgrade whose URL is 9 KiB (over websockets' 8 KiB line),
  read whatever comes within 1 s, and never close their side; how many connections the gateway still holds
  is read from `/metrics` at the end and 3 s later (the attacker still holding its sockets).

The attackers run in a process of their own, from 127.0.0.1; the /healthz prober opens a fresh connection
every 50 ms from 127.0.0.2 (so the per-address limit of the attacker's address is not the prober's).
`--root` runs the gateway of another checkout (e.g. a `git worktree` of the commit before the fix) to
compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from pathlib import Path

from loadtest.aio import within
from loadtest.floodprobe import ROOT, FloodGateway, FloodSampler, prober_get

ATTACKERS = 8
CHUNK = 64 * 1024
HUGE = 113 * 10**6
#: sockets an attacker process keeps open at most (its descriptors): above the per-address limit (256)
MAX_HELD = 800


# -- the attackers (in their own process) ------------------------------------------------------------------


async def _headers_attacker(port: int, until: float, stats: dict) -> None:
    loop = asyncio.get_running_loop()
    piece = b"a" * CHUNK
    while time.monotonic() < until:
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        sent = 0
        try:
            await loop.sock_sendall(sock, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            while sent < HUGE and time.monotonic() < until:
                await within(loop.sock_sendall(sock, piece), 1.0)
                sent += CHUNK
        except (OSError, asyncio.TimeoutError):
            pass  # the gateway answered and shut, or stopped reading
        try:
            answer = await within(loop.sock_recv(sock, 4096), 0.5)
        except (OSError, asyncio.TimeoutError):
            answer = b""
        stats["connections"] += 1
        stats["bytes_written"] += sent  # written into the socket; what the gateway read is far less
        stats["answered_431"] += answer.startswith(b"HTTP/1.1 431")
        sock.close()


async def _ws_size_attacker(port: int, until: float, stats: dict, held: list[socket.socket]) -> None:
    loop = asyncio.get_running_loop()
    request = (
        b"GET /ws?x=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    while time.monotonic() < until:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            answer = await within(loop.sock_recv(sock, 4096), 1.0)
        except (OSError, asyncio.TimeoutError):
            answer = b""
        stats["connections"] += 1
        status = answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
        stats[f"answered_{status}"] = stats.get(f"answered_{status}", 0) + 1
        held.append(sock)  # never closed by the attacker: only the gateway can free it
        if len(held) > MAX_HELD:  # the attacker's own descriptors
            held.pop(0).close()


def attack(kind: str, port: int, seconds: float, out: "multiprocessing.Queue[dict]") -> None:
    async def main() -> dict:
        until = time.monotonic() + seconds
        stats: dict = {"connections": 0, "bytes_written": 0, "answered_431": 0}
        held: list[socket.socket] = []
        if kind == "headers":
            await asyncio.gather(*(_headers_attacker(port, until, stats) for _ in range(ATTACKERS)))
        else:
            await asyncio.gather(*(_ws_size_attacker(port, until, stats, held) for _ in range(ATTACKERS)))
        out.put(stats)
        await asyncio.sleep(6)  # hold the sockets while the prober reads the gateway's connection count
        for sock in held:
            sock.close()
        return stats

    asyncio.run(main())


def open_connections(port: int) -> int:
    for line in prober_get(port, "/metrics").decode(errors="replace").splitlines():
        if line.startswith("fanout_http_connections "):
            return int(float(line.split()[1])) - 1  # not this scrape's own
    return -1


def run(kind: str, seconds: float, root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="edge-flood-") as tmp:
        gateway = FloodGateway(Path(tmp), {"ingest": {"enabled": False}}, root=root)
        port = gateway.http_port
        try:
            sampler = FloodSampler(gateway.proc.pid, port)
            out: multiprocessing.Queue = multiprocessing.Queue()
            attacker = multiprocessing.Process(target=attack, args=(kind, port, seconds, out))
            attacker.start()
            sampler.sample(seconds)
            stats = out.get(timeout=30)
            held = open_connections(port)
            time.sleep(3)  # the attacker still holds every socket it kept: are they still held here?
            held_later = open_connections(port)
            sampler.stop()
            attacker.join(15)
            sampler.settle(0.5)
        finally:
            gateway.stop()
    return {
        "flood": kind,
        "seconds": seconds,
        "attacker": stats,
        "connections_held_at_end": held,
        "connections_held_3s_later": held_later,
        **sampler.figures(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.edge_floods", description=__doc__.split("\n")[0])
    parser.add_argument("flood", choices=("headers", "ws-size", "all"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose gateway runs (default: this)")
    args = parser.parse_args(argv)
    for kind in ("headers", "ws-size") if args.flood == "all" else (args.flood,):
        print(json.dumps(run(kind, args.seconds, args.root.resolve())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
