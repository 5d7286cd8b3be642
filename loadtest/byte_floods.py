"""``python -m loadtest.byte_floods ping|echo|topics|ingest|fragments|auth|all [--seconds S] [--root TREE]``:
the per-connection byte and CPU floods of issue 24 against a gateway process of its own, printing the
gateway's RSS (start, peak, end), its CPU time, and the /healthz delay another client sees meanwhile (p50,
p99, max). Figures, not asserts: docs/security.md quotes them.

* ping: 4 connections that never read send 125-byte pings as fast as the gateway takes them;
* echo: 8 connections that never read send `rpc echo` with 60 KB params, reconnecting when cut;
* topics: with 5,000 topics, 8 connections that never read send frames of 100 `rpc topics`, reconnecting;
* ingest: 4 publishers that never read send lines that are each answered with an error line;
* fragments: 4 connections send a message in one-byte fragments, reconnecting when closed;
* auth: with a 4096-bit RS256 key, 8 connections send frames of 60 `auth` with a bad signature (~50 KB).

The attackers run in a process of their own, from 127.0.0.1; the prober opens a fresh connection every
50 ms from 127.0.0.2. `--root` runs the gateway of another checkout (e.g. one before the fix) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from loadtest.aio import within
from loadtest.floodprobe import ROOT, FloodGateway, FloodSampler, recv_until, ws_frame

FLOODS = ("ping", "echo", "topics", "ingest", "fragments", "auth")


def _rsa_key(workdir: Path) -> tuple[Path, bytes]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    path = workdir / "rs256.pem"
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return path, private


# -- the attackers (in their own process) ------------------------------------------------------------------


async def _ws_open(port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that does not read
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16))
    await loop.sock_sendall(
        sock,
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: "
        b"Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await within(loop.sock_recv(sock, 1), 5)
        if not chunk:
            raise OSError("closed during the handshake")
        head += chunk
    return sock


async def _ws_flood(port: int, until: float, stats: dict, chunk: bytes, *, read: bool = False) -> None:
    """Open a connection and send `chunk` again and again (reading only if `read`); reconnect when cut."""
    loop = asyncio.get_running_loop()
    while time.monotonic() < until:
        try:
            sock = await _ws_open(port)
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.05)
            continue
        stats["connections"] += 1
        try:
            while time.monotonic() < until:
                await within(loop.sock_sendall(sock, chunk), 1.0)
                stats["bytes"] += len(chunk)
                if read:
                    try:
                        while await within(loop.sock_recv(sock, 1 << 20), 0.001):
                            pass
                    except asyncio.TimeoutError:
                        pass
        except asyncio.TimeoutError:
            stats["stalled"] += 1  # the gateway stopped reading: hold the connection until it cuts it
            try:
                while time.monotonic() < until:
                    if not await within(loop.sock_recv(sock, 1), until - time.monotonic()):
                        break
            except (OSError, asyncio.TimeoutError):
                pass
        except OSError:
            pass
        sock.close()


async def _ingest_flood(port: int, until: float, stats: dict) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    stats["connections"] += 1
    junk = b"x\n" * 32768
    try:
        while time.monotonic() < until:
            await within(loop.sock_sendall(sock, junk), max(0.01, until - time.monotonic()))
            stats["bytes"] += len(junk)
    except (OSError, asyncio.TimeoutError):
        stats["stalled"] += 1
    sock.close()


def _bad_token(private: bytes) -> str:
    import jwt

    token = jwt.encode({"sub": "attacker", "exp": int(time.time()) + 600}, private, algorithm="RS256")
    return token[:-8] + "AAAAAAAA"


def attack(kind: str, ports: dict, seconds: float, private: bytes, out: "multiprocessing.Queue[dict]") -> None:
    async def main() -> None:
        until = time.monotonic() + seconds
        stats = {"connections": 0, "bytes": 0, "stalled": 0}
        http = ports["http_port"]
        if kind == "ping":
            chunk = ws_frame(0x9, b"p" * 125) * 500
            tasks = [_ws_flood(http, until, stats, chunk) for _ in range(4)]
        elif kind == "echo":
            echo = json.dumps({"op": "rpc", "method": "echo", "params": "x" * 60_000}).encode()
            tasks = [_ws_flood(http, until, stats, ws_frame(0x1, echo)) for _ in range(8)]
        elif kind == "topics":
            frame = json.dumps([{"op": "rpc", "method": "topics", "params": None}] * 100).encode()
            tasks = [_ws_flood(http, until, stats, ws_frame(0x1, frame)) for _ in range(8)]
        elif kind == "ingest":
            tasks = [_ingest_flood(ports["ingest_port"], until, stats) for _ in range(4)]
        elif kind == "fragments":
            chunk = ws_frame(0x1, b"[", fin=False) + ws_frame(0x0, b" ", fin=False) * 10_000
            tasks = [_ws_flood(http, until, stats, chunk) for _ in range(4)]
        else:
            token = _bad_token(private)
            frame = json.dumps([{"op": "auth", "token": token}] * 60).encode()  # ~50 KB: under max_frame_bytes
            tasks = [_ws_flood(http, until, stats, ws_frame(0x1, frame), read=True) for _ in range(8)]
        await asyncio.gather(*tasks)
        out.put(stats)

    asyncio.run(main())


def seed_topics(port: int, count: int) -> None:
    """`count` topics, made through the ingest (one publish each), and a sync that says they landed."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        lines = b"".join(b'{"topic":"bulk.t%d","data":1}\n' % i for i in range(count))
        sock.sendall(lines + b'{"sync":1}\n')
        recv_until(sock, b'"synced"')


def run(kind: str, seconds: float, root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="byte-flood-") as tmp:
        key_file, private = _rsa_key(Path(tmp)) if kind == "auth" else (None, b"")
        gateway = FloodGateway(Path(tmp), {"auth": {"jwt_public_key_file": str(key_file)}} if key_file else {}, root=root)
        try:
            if kind == "topics":
                seed_topics(gateway.info["ingest_port"], 5000)
            sampler = FloodSampler(gateway.proc.pid, gateway.http_port)
            out: multiprocessing.Queue = multiprocessing.Queue()
            attacker = multiprocessing.Process(target=attack, args=(kind, gateway.info, seconds, private, out))
            attacker.start()
            sampler.sample(seconds)
            stats = out.get(timeout=60)
            sampler.stop()
            attacker.join(15)
            sampler.settle(1)
        finally:
            gateway.stop()
    return {"flood": kind, "seconds": seconds, "attacker": stats, **sampler.figures()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.byte_floods", description=__doc__.split("\n")[0])
    parser.add_argument("flood", choices=(*FLOODS, "all"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose gateway runs (default: this)")
    args = parser.parse_args(argv)
    for kind in FLOODS if args.flood == "all" else (args.flood,):
        print(json.dumps(run(kind, args.seconds, args.root.resolve())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
