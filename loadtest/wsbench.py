"""``python -m loadtest wsbench``: what one received WebSocket frame costs a load-generator client.

A blaster process accepts WebSocket connections and writes pre-encoded gateway-like batch frames as fast as
the socket takes them. The same frames are read, and parsed with orjson, by (a) :mod:`loadtest.wsclient`
(websockets' sans-I/O protocol under an asyncio.Protocol) and (b) the websockets asyncio client. The figure
that matters is client CPU per frame: it decides how many subscribers one load process can carry.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import orjson
from websockets.utils import accept_key

from loadtest.aio import run_loop, within


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = bytes([0x81, n])
    elif n < 65536:
        head = bytes([0x81, 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x81, 127]) + n.to_bytes(8, "big")
    return head + payload


def batch(entries: int, pad: int) -> bytes:
    items = [
        orjson.dumps(
            {
                "type": "msg",
                "topic": f"t{i % 10:04d}",
                "seq": i,
                "data": {"ts": time.time_ns(), "t": f"t{i % 10:04d}", "n": i, "pad": "x" * pad},
            }
        )
        for i in range(entries)
    ]
    return b"[" + b",".join(items) + b"]"


async def _blast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: bytes) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n") if line.lower().startswith(b"sec-websocket-key"))
    accept = accept_key(key.decode()).encode()
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )
    writer.write(stream)
    writer.write(b"\x88\x02\x03\xe8")  # close 1000
    await writer.drain()
    try:
        await within(reader.read(), 5)
    except (asyncio.TimeoutError, ConnectionError):
        pass
    writer.close()


def _server(sock: socket.socket, stream: bytes) -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: _blast(r, w, stream), sock=sock)
        async with server:
            await server.serve_forever()

    run_loop(main())


async def _ours(port: int, frames: int) -> int:
    from loadtest.wsclient import connect

    done = asyncio.get_running_loop().create_future()
    count = [0, 0]

    class Sink:
        def ws_open(self) -> None: ...

        def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
            for m in messages:
                count[1] += len(orjson.loads(m))
            count[0] += len(messages)
            if count[0] >= frames and not done.done():
                done.set_result(None)

        def ws_closed(self, reason: str) -> None:
            if not done.done():
                done.set_result(None)

    client = await connect("127.0.0.1", port, "/", Sink())
    await done
    client.close()
    return count[0]


async def _websockets(port: int, frames: int) -> int:
    from websockets.asyncio.client import connect

    got = 0
    async with connect(f"ws://127.0.0.1:{port}/", compression=None, max_size=None) as ws:
        async for message in ws:
            orjson.loads(message)
            got += 1
            if got >= frames:
                break
    return got


def measure(kind: str, port: int, frames: int) -> dict[str, float]:
    async def main() -> int:
        return await (_ours if kind == "ours" else _websockets)(port, frames)

    wall, cpu = time.perf_counter(), time.process_time()
    got = run_loop(main())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"frames": got, "frames_per_s": got / wall, "cpu_us_per_frame": 1e6 * cpu / max(got, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest wsbench", description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--entries", type=int, nargs="+", default=[1, 20], help="entries per batch frame")
    parser.add_argument("--pad", type=int, default=64)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"WebSocket client cost, {args.frames:,} frames per run")
    for col in ("entries/frame", "client", "frames/s", "entries/s", "client CPU µs/frame"):
        table.add_column(col, justify="right")
    ctx = mp.get_context("spawn")
    for entries in args.entries:
        stream = _frame(batch(entries, args.pad)) * args.frames
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        server = ctx.Process(target=_server, args=(sock, stream), daemon=True)
        server.start()
        try:
            for kind in ("ours", "websockets"):
                r: dict[str, Any] = measure(kind, sock.getsockname()[1], args.frames)
                table.add_row(
                    str(entries),
                    "wsclient (sans-I/O)" if kind == "ours" else "websockets asyncio",
                    f"{r['frames_per_s']:,.0f}",
                    f"{r['frames_per_s'] * entries:,.0f}",
                    f"{r['cpu_us_per_frame']:.1f}",
                )
        finally:
            server.terminate()
            server.join()
            sock.close()
    Console().print(table)
    print(f"(one core per process; {os.cpu_count()} cores here)")
    return 0
