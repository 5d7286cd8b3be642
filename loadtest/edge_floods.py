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
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTACKERS = 8
CHUNK = 64 * 1024
HUGE = 113 * 10**6
#: sockets an attacker process keeps open at most (its descriptors): above the per-address limit (256)
MAX_HELD = 800


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(root: Path, workdir: Path) -> tuple[subprocess.Popen, int]:
    config = workdir / "gateway.toml"
    config.write_text('[server]\nhost = "127.0.0.1"\nport = 0\nadmin_token = "flood-admin-token"\n'
                      'log_level = "warning"\n[ingest]\nenabled = false\n[rawtcp]\nenabled = false\n')
    ready = workdir / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file",
                             str(ready)], cwd=root, env=env, stdout=open(workdir / "gateway.log", "wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((workdir / "gateway.log").read_text(errors="replace")[-2000:])
        time.sleep(0.05)
    time.sleep(0.2)
    return proc, int(json.loads(ready.read_text())["http_port"])


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
                await asyncio.wait_for(loop.sock_sendall(sock, piece), 1.0)
                sent += CHUNK
        except (OSError, asyncio.TimeoutError):
            pass  # the gateway answered and shut, or stopped reading
        try:
            answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), 0.5)
        except (OSError, asyncio.TimeoutError):
            answer = b""
        stats["connections"] += 1
        stats["bytes_written"] += sent  # written into the socket; what the gateway read is far less
        stats["answered_431"] += answer.startswith(b"HTTP/1.1 431")
        sock.close()


async def _ws_size_attacker(port: int, until: float, stats: dict, held: list[socket.socket]) -> None:
    loop = asyncio.get_running_loop()
    request = (b"GET /ws?x=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
               b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    while time.monotonic() < until:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), 1.0)
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


# -- the prober --------------------------------------------------------------------------------------------

def healthz_ms(port: int) -> float:
    start = time.perf_counter()
    with socket.socket() as sock:
        sock.settimeout(10)
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while b'"ok"' not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    if b'"ok"' not in data:
        return float("inf")
    return (time.perf_counter() - start) * 1000


def open_connections(port: int) -> int:
    with socket.socket() as sock:
        sock.settimeout(10)
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("fanout_http_connections "):
            return int(float(line.split()[1])) - 1  # not this scrape's own
    return -1


def run(kind: str, seconds: float, root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="edge-flood-") as tmp:
        proc, port = start_gateway(root, Path(tmp))
        try:
            before_ms = [healthz_ms(port) for _ in range(20)]
            rss_start, cpu_start = rss_mib(proc.pid), cpu_s(proc.pid)
            out: multiprocessing.Queue = multiprocessing.Queue()
            attacker = multiprocessing.Process(target=attack, args=(kind, port, seconds, out))
            attacker.start()
            delays, peak = [], rss_start
            stop = time.monotonic() + seconds
            while time.monotonic() < stop:
                delays.append(healthz_ms(port))
                peak = max(peak, rss_mib(proc.pid))
                time.sleep(0.05)
            stats = out.get(timeout=30)
            held = open_connections(port)
            time.sleep(3)  # the attacker still holds every socket it kept: are they still held here?
            held_later = open_connections(port)
            peak = max(peak, rss_mib(proc.pid))
            cpu = cpu_s(proc.pid) - cpu_start
            attacker.join(15)
            time.sleep(0.5)
            rss_end = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(15)
    delays.sort()
    return {"flood": kind, "seconds": seconds, "attacker": stats, "connections_held_at_end": held,
            "connections_held_3s_later": held_later,
            "rss_mib": {"start": round(rss_start, 1), "peak": round(peak, 1), "end": round(rss_end, 1),
                        "peak_minus_start": round(peak - rss_start, 1)},
            "gateway_cpu_s": round(cpu, 2),
            "healthz_ms": {"before_max": round(max(before_ms), 1), "probes": len(delays),
                           "p50": round(delays[len(delays) // 2], 1),
                           "p99": round(delays[min(len(delays) - 1, int(len(delays) * 0.99))], 1),
                           "max": round(delays[-1], 1)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.edge_floods", description=__doc__.split("\n")[0])
    parser.add_argument("flood", choices=("headers", "ws-size", "all"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose gateway runs (default: this)")
    args = parser.parse_args(argv)
    for kind in (("headers", "ws-size") if args.flood == "all" else (args.flood,)):
        print(json.dumps(run(kind, args.seconds, args.root.resolve())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
