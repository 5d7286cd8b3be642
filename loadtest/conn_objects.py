"""``python -m loadtest conn-objects``: what one idle, subscribed WebSocket connection holds in the gateway,
object by object.

The gateway runs in this process (on uvloop, the shipped defaults with the load runs' topic rule: every
topic anonymous); the clients run in a child process (``loadtest/wsclient.py``), so that nothing of theirs
is counted. K clients connect and each subscribes to one of 100 quiet topics, three times over:

1. **resident set**: RSS of this process before and with the K clients (no tracing), per connection: what
   `idle-memory` measures, without the load process;
2. **allocations** (`tracemalloc`, `--frames` deep): a snapshot before and with K more clients, the
   difference per connection grouped by allocation site (the innermost frame, and the gateway / uvicorn /
   websockets / core frames that led to it), and by file. RSS minus what is traced is what Python's
   allocator does not see (glibc's overhead and libuv's own allocations, pymalloc's free blocks);
3. **objects**: the objects that appeared, by type (`gc.get_objects`, per connection); and one connection
   walked from its roots (the protocol, its transport, the core's client) through `gc.get_referents`,
   every object not there before it connected counted once with `sys.getsizeof`.

A warm-up crowd comes and leaves first, so that the topics exist and one-time caches are filled.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import linecache
import os
import sys
import tempfile
import time
import tracemalloc
import types
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loadtest.aio import within
from loadtest.gatewayproc import config_text
from loadtest.procstat import raise_nofile_limit, read_stat

CONNECT_WAVE = 200
TOPICS = 100
#: where the report looks for the frame that explains an allocation (outermost first is not useful)
INTERESTING = ("/gateway/", "/core/", "/uvicorn/", "/websockets/", "/uvloop/", "/asyncio/")


# -- the client side (a child process) ------------------------------------------------------------------------


async def _clients(port: int) -> None:
    """Reads commands on stdin: `open K` connects K more clients (each subscribes; answered `ok N` once all
    are subscribed), `close` closes all (answered `ok 0`), end of input ends it."""
    from loadtest.idle_memory import Subscriber
    from loadtest.wsclient import WsClient, connect

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    conns: list[WsClient] = []
    while True:
        line = (await reader.readline()).decode().split()
        if not line:
            break
        if line[0] == "open":
            count = int(line[1])
            acked, counter = asyncio.Event(), [0]
            fresh: list[WsClient] = []
            for wave in range(0, count, CONNECT_WAVE):
                batch = [
                    connect("127.0.0.1", port, "/ws", Subscriber(acked, counter, count))
                    for _ in range(wave, min(count, wave + CONNECT_WAVE))
                ]
                fresh.extend(await asyncio.gather(*batch))
            for i, conn in enumerate(fresh):
                conn.send_text(b'{"op":"subscribe","topic":"idle.%d"}' % ((len(conns) + i) % TOPICS))
            await within(acked.wait(), 120)
            conns.extend(fresh)
        elif line[0] == "close":
            for conn in conns:
                conn.close()
            conns.clear()
        print(f"ok {len(conns)}", flush=True)


# -- the gateway side ---------------------------------------------------------------------------------------


class Crowd:
    """The child process of clients, driven line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def command(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        answer = await within(self.proc.stdout.readline(), 180)
        if not answer.startswith(b"ok"):
            raise RuntimeError(f"the clients' process answered {answer!r}")


def _rss() -> int:
    stat = read_stat(os.getpid())
    assert stat is not None
    return stat[2]


async def _until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway did not see the clients come or go")
        await asyncio.sleep(0.05)


def _collect() -> None:
    gc.unfreeze()  # the gateway's GC policy freezes survivors every second: count them all
    gc.collect()


def _where(trace: tracemalloc.Traceback) -> str:
    """The innermost frame, then up to three outer frames in the gateway, the core or the libraries."""
    frames = list(reversed(trace))  # tracemalloc's order is oldest first
    inner = frames[0]
    parts = [f"{_short(inner.filename)}:{inner.lineno}"]
    for frame in frames[1:]:
        if any(key in frame.filename for key in INTERESTING) and len(parts) < 4:
            parts.append(f"{_short(frame.filename)}:{frame.lineno}")
    return " < ".join(parts)


def _short(filename: str) -> str:
    """A path from its package on: `site-packages/uvicorn/x.py` is `uvicorn/x.py`, `/work/h/gateway/x.py`
    `gateway/x.py`, the standard library's `asyncio/x.py`."""
    for key in ("site-packages/", "/gateway/", "/core/", "/loadtest/"):
        at = filename.rfind(key)
        if at >= 0:
            return filename[at + 1 :] if key != "site-packages/" else filename[at + len(key) :]
    at = filename.find("/lib/python3.")
    return filename[filename.index("/", at + 5) + 1 :] if at >= 0 else filename


def _source(trace: tracemalloc.Traceback) -> str:
    frame = trace[-1]
    return linecache.getline(frame.filename, frame.lineno).strip()[:70]


def _skip(obj: object) -> bool:
    return isinstance(
        obj,
        (
            type,
            types.ModuleType,
            types.FunctionType,
            types.BuiltinFunctionType,
            types.CodeType,
            types.MethodDescriptorType,
            types.WrapperDescriptorType,
        ),
    )


def walk(roots: Iterable[object], before: set[int], stop: set[int]) -> tuple[int, Counter[str], Counter[str]]:
    """Every object reachable from `roots` that is neither shared (in `before`) nor another connection's root
    (`stop`), counted once: (bytes, bytes by type, count by type)."""
    seen: set[int] = set()
    todo = list(roots)
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    while todo:
        obj = todo.pop()
        key = id(obj)
        if key in seen or key in before or key in stop or _skip(obj):
            continue
        seen.add(key)
        name = type(obj).__qualname__
        sizes[name] += sys.getsizeof(obj)
        counts[name] += 1
        todo.extend(gc.get_referents(obj))
    return sum(sizes.values()), sizes, counts


async def measure(clients: int, frames: int, top: int, settle_s: float = 0.5) -> dict[str, Any]:
    """`settle_s`: the pause after each crowd came or left (twice that before an RSS reading)."""
    from gateway.config import load_config
    from gateway.server import start_gateway
    from gateway.transports.ws import WebSocketProtocol

    workdir = Path(tempfile.mkdtemp(prefix="conn-objects-"))
    config_path = workdir / "gateway.toml"
    config_path.write_text(config_text("conn-objects-admin-token"))
    config = load_config(
        config_path, environ={"GATEWAY_SERVER_MAX_CONNECTIONS": str(3 * clients + 1000), "GATEWAY_SERVER_LOG_LEVEL": "warning"}
    )
    running = await start_gateway(config)
    hub = running.hub
    assert running.server is not None
    connections = running.server.server_state.connections
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadtest.conn_objects",
        "--clients-of-port",
        str(running.http_port),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        preexec_fn=raise_nofile_limit,
    )
    crowd = Crowd(proc)
    result: dict[str, Any] = {"clients": clients}
    try:

        async def arrive(count: int) -> None:
            expected = len(hub.clients.conns) + count
            await crowd.command(f"open {count}")
            await _until(lambda: len(hub.clients.conns) >= expected)
            await asyncio.sleep(settle_s)

        async def leave() -> None:
            await crowd.command("close")
            await _until(lambda: not hub.clients.conns and not connections)
            await asyncio.sleep(settle_s)

        # warm-up: the topics exist, one-time caches are filled, the pools of a first crowd are there
        await arrive(min(clients, TOPICS))
        await leave()
        _collect()
        await asyncio.sleep(2 * settle_s)

        # 1. resident set
        _collect()
        rss_before = _rss()
        await arrive(clients)
        _collect()
        await asyncio.sleep(2 * settle_s)
        rss_with = _rss()
        await leave()
        _collect()
        result["rss_per_conn"] = (rss_with - rss_before) / clients

        # 2. allocations, 3. objects
        _collect()
        # what is there before, by id: kept alive meanwhile, so that no new object gets the id of a dead one;
        # taken before tracing starts (traced, its ~300k ids made each snapshot's grouping take seconds)
        shared = gc.get_objects()
        shared += [r for obj in shared for r in gc.get_referents(obj)]
        before = {id(o) for o in shared}
        tracemalloc.start(frames)
        _collect()
        types_before = Counter(type(o).__qualname__ for o in gc.get_objects())
        snap_before = tracemalloc.take_snapshot()
        await arrive(clients)
        _collect()
        snap_with = tracemalloc.take_snapshot()
        objects = gc.get_objects()
        types_with = Counter(type(o).__qualname__ for o in objects)
        sizes_with: Counter[str] = Counter()
        for obj in objects:
            sizes_with[type(obj).__qualname__] += sys.getsizeof(obj)
        del objects
        # tracemalloc's and this file's own allocations left out, by their innermost frame as an exclusive
        # tracemalloc.Filter would: on the grouped statistics, not on every trace (filter_traces took ~20 s)
        own = {tracemalloc.__file__, __file__}
        by_site = [s for s in snap_with.compare_to(snap_before, "traceback") if s.traceback[-1].filename not in own]
        by_file = [s for s in snap_with.compare_to(snap_before, "filename") if s.traceback[-1].filename not in own]
        traced = sum(stat.size_diff for stat in by_file)
        result["traced_per_conn"] = traced / clients
        result["sites"] = [
            (stat.size_diff / clients, stat.count_diff / clients, _where(stat.traceback), _source(stat.traceback))
            for stat in by_site[:top]
            if stat.size_diff > 0
        ]
        result["files"] = [
            (stat.size_diff / clients, _short(stat.traceback[0].filename)) for stat in by_file[:top] if stat.size_diff > 0
        ]
        result["types"] = [
            (name, (types_with[name] - types_before.get(name, 0)) / clients, sizes_with[name] / max(1, types_with[name]))
            for name, _ in (types_with - types_before).most_common(top)
        ]
        # one connection, object by object
        protos = [c for c in connections if isinstance(c, WebSocketProtocol) and c.connection is not None]
        stop = {id(p) for p in protos} | {id(p.transport) for p in protos} | {id(p.connection) for p in protos}
        proto = protos[-1]
        conn = proto.connection
        assert conn is not None
        client = hub.scheduler.engine.client(conn.identity.client_id)
        roots: list[object] = [proto, proto.transport, conn, client]
        for root in roots:
            stop.discard(id(root))
        total, sizes, counts = walk(roots, before, stop)
        result["walk_bytes"] = total
        result["walk"] = [(name, counts[name], size) for name, size in sizes.most_common(top)]
        del shared
        tracemalloc.stop()
        await leave()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        await proc.wait()
        await running.stop()
    return result


def report(result: dict[str, Any]) -> None:
    k = result["clients"]
    print(f"{k} idle subscribed WebSocket clients (gateway in this process, clients in a child process)")
    print(f"  RSS per connection:    {result['rss_per_conn']:8.0f} B ({result['rss_per_conn'] / 1024:.2f} KiB)")
    print(f"  traced per connection: {result['traced_per_conn']:8.0f} B (tracemalloc: Python's allocators)")
    print(
        f"  untraced:              {result['rss_per_conn'] - result['traced_per_conn']:8.0f} B"
        " (RSS - traced: glibc overhead, libuv, allocator slack)"
    )
    print("\nby allocation site (bytes and blocks per connection):")
    for size, count, where, line in result["sites"]:
        print(f"  {size:7.0f} B {count:5.2f}  {where}\n{'':20}{line}")
    print("\nby file (bytes per connection):")
    for size, name in result["files"]:
        print(f"  {size:7.0f} B  {name}")
    print("\nnew objects by type (gc-tracked: count per connection, mean getsizeof):")
    for name, count, mean in result["types"]:
        print(f"  {count:6.2f} x {mean:6.0f} B  {name}")
    print(
        f"\none connection walked from its protocol, transport, WSConnection and core Client:"
        f" {result['walk_bytes']} B (getsizeof, objects not shared)"
    )
    for name, count, size in result["walk"]:
        print(f"  {size:6d} B  {count:3d} x {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest conn-objects", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--frames", type=int, default=10, help="tracemalloc frames per allocation")
    parser.add_argument("--top", type=int, default=25, help="lines of each table")
    parser.add_argument("--clients-of-port", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    raise_nofile_limit()
    import uvloop  # the gateway's loop (a dependency, pyproject.toml)

    if args.clients_of_port is not None:
        uvloop.run(_clients(args.clients_of_port))
        return 0
    if args.clients < 1:
        parser.error("--clients must be at least 1")
    report(uvloop.run(measure(args.clients, args.frames, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
