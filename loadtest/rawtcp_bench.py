"""Throughput of the raw TCP broadcaster (docs/design/byte-ring.md) on loopback, next to iperf3.

    python -m loadtest.rawtcp_bench [--duration 5] [--receivers 16] [--install] [--no-iperf]

The gateway (``gateway.transports.rawtcp.RawBroadcastServer``, uvloop when available) runs in a child process
so it has a core of its own; this process is the load: one sender pushing as fast as the gateway
reads and ``--receivers`` receivers counting what they get. After a warm-up, the bytes received over
``--duration`` seconds give the aggregate receiver Gbit/s (docs/design/byte-ring.md §1 counts receiver egress as
16 x the sender's rate). Then, when ``iperf3`` is on PATH (``--install`` runs ``apt-get install -y
iperf3`` when it is not), ``iperf3 -c 127.0.0.1 -P <receivers> -t <duration> -J`` against ``iperf3 -s``
on a free loopback port gives the machine's loopback TCP aggregate, and the ratio is printed.
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, cast

from .ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MIB = 1024 * 1024


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the gateway
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# ------------------------------------------------------------- gateway child


def serve_child(config_json: str) -> None:
    """Child process body: run the broadcaster; print its ports as one JSON line; answer each
    ``stats`` line on stdin with a JSON line; stop at end of stdin."""
    from core.byte_ring import ByteRingConfig
    from gateway.transports.rawtcp import RawBroadcastServer

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = RawBroadcastServer(ByteRingConfig(**json.loads(config_json)))
        await server.start(HOST, 0, 0)
        print(
            json.dumps({"sender_port": server.sender_port, "receiver_port": server.receiver_port, "loop": type(loop).__module__}),
            flush=True,
        )
        done = loop.create_future()

        def answer() -> None:
            print(json.dumps(server.stats()), flush=True)

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def read_stdin() -> None:  # a thread: stdin is a pipe the loop need not watch
            for line in sys.stdin:
                if line.strip() == "stats":
                    loop.call_soon_threadsafe(answer)
            loop.call_soon_threadsafe(finish)

        threading.Thread(target=read_stdin, daemon=True).start()
        await done
        await server.stop()

    with asyncio.Runner(loop_factory=_new_loop) as runner:
        runner.run(main())


class _Child:
    def __init__(self, config: dict[str, Any]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        code = "import sys; from loadtest.rawtcp_bench import serve_child; serve_child(sys.argv[1])"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        line = self.stdout.readline()
        if not line:
            raise RuntimeError("the gateway child exited before listening")
        info = json.loads(line)
        self.sender_port: int = info["sender_port"]
        self.receiver_port: int = info["receiver_port"]
        self.loop_kind: str = info["loop"]

    def stats(self) -> dict[str, Any]:
        self.stdin.write("stats\n")
        self.stdin.flush()
        return json.loads(self.stdout.readline())

    def close(self) -> None:
        try:
            self.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------- load


class _Receiver(asyncio.BufferedProtocol):
    def __init__(self, bufsize: int) -> None:
        self.buf = memoryview(bytearray(bufsize))
        self.count = 0
        self.closed = asyncio.get_event_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.count += nbytes

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


class _Sender(asyncio.Protocol):
    """Writes one block again and again while the transport is not paused."""

    def __init__(self, block: bytes) -> None:
        self.block = block
        self.paused = False
        self.transport: asyncio.Transport | None = None
        self.written = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        self.transport.set_write_buffer_limits(high=4 * MIB)
        self.fill()

    def fill(self) -> None:
        transport = self.transport
        while transport is not None and not self.paused and not transport.is_closing():
            transport.write(self.block)
            self.written += len(self.block)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        asyncio.get_event_loop().call_soon(self.fill)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def _load(child: _Child, receivers: int, duration: float, warmup: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    rx: list[_Receiver] = []
    for _ in range(receivers):
        _, proto = await loop.create_connection(lambda: _Receiver(4 * MIB), HOST, child.receiver_port)
        rx.append(proto)
    deadline = time.monotonic() + 5
    while child.stats()["active_receivers"] < receivers:
        if time.monotonic() > deadline:
            raise RuntimeError("receivers did not all register")
        await asyncio.sleep(0.01)
    block = os.urandom(1 * MIB)
    transport, sender = await loop.create_connection(lambda: _Sender(block), HOST, child.sender_port)
    await asyncio.sleep(warmup)
    gw0 = child.stats()
    before = [r.count for r in rx]
    t0 = time.perf_counter()
    await asyncio.sleep(duration)
    after = [r.count for r in rx]
    elapsed = time.perf_counter() - t0
    gw1 = child.stats()
    transport.abort()
    stats = child.stats()
    per = [(a - b) * 8 / elapsed / 1e9 for a, b in zip(after, before)]
    sender_gbps = (gw1["bytes_received"] - gw0["bytes_received"]) * 8 / elapsed / 1e9
    lost = sum(1 for r in rx if r.closed.done())
    return {
        "elapsed_s": round(elapsed, 3),
        "receivers": receivers,
        "aggregate_gbps": round(sum(per), 3),
        "per_receiver_gbps_min": round(min(per), 3),
        "per_receiver_gbps_max": round(max(per), 3),
        "sender_rate_gbps": round(sender_gbps, 3),
        "receivers_disconnected": lost,
        "gateway_stats": stats,
    }


def run_broadcaster(config: dict[str, Any], receivers: int, duration: float, warmup: float) -> dict[str, Any]:
    child = _Child(config)
    try:
        with asyncio.Runner(loop_factory=_new_loop) as runner:
            result = runner.run(_load(child, receivers, duration, warmup))
        result["gateway_loop"] = child.loop_kind
        return result
    finally:
        child.close()


# ------------------------------------------------------------------ iperf3


def ensure_iperf3(install: bool) -> str | None:
    path = shutil.which("iperf3")
    if path or not install:
        return path
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "iperf3"]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
    return shutil.which("iperf3")


def run_iperf3(iperf3: str, streams: int, duration: float) -> dict[str, Any]:
    port = free_port()
    server = subprocess.Popen([iperf3, "-s", "-B", HOST, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        report: dict[str, Any] = {}
        for _ in range(20):  # until the server listens (no probe: iperf3 -s counts every connection)
            time.sleep(0.1)
            out = subprocess.run(
                [iperf3, "-c", HOST, "-p", str(port), "-P", str(streams), "-t", str(max(1, round(duration))), "-J"],
                capture_output=True,
                text=True,
                timeout=duration + 30,
            )
            report = json.loads(out.stdout or "{}")
            if "unable to connect" not in str(report.get("error", "")):
                break
        if "error" in report or "end" not in report:
            raise RuntimeError(f"iperf3: {report.get('error', out.stderr.strip())}")
        received = report["end"]["sum_received"]["bits_per_second"]
        return {
            "aggregate_gbps": round(received / 1e9, 3),
            "streams": streams,
            "version": report.get("start", {}).get("version", ""),
        }
    finally:
        server.terminate()
        server.wait(timeout=5)


# -------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.rawtcp_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds (default 5)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument("--receivers", type=int, default=16, help="receivers (default 16, docs/design/byte-ring.md §7)")
    parser.add_argument("--capacity-mib", type=int, default=256, help="ring capacity (docs/design/byte-ring.md §7: 256)")
    parser.add_argument("--recv-chunk-kib", type=int, default=64, help="sender recv size (docs/design/byte-ring.md §7: 64)")
    parser.add_argument("--install", action="store_true", help="apt-get install iperf3 when missing")
    parser.add_argument("--no-iperf", action="store_true", help="skip the iperf3 comparison")
    args = parser.parse_args(argv)

    capacity = args.capacity_mib * MIB
    config = {
        "capacity_bytes": capacity,
        "recv_chunk_bytes": args.recv_chunk_kib * 1024,
        "max_receivers": max(16, args.receivers),
    }
    if capacity != 256 * MIB:  # keep the default lag limits (docs/design/byte-ring.md §7) in proportion to the ring
        config.update(soft_lag_bytes=capacity // 8, hard_lag_bytes=capacity * 3 // 8)

    print(
        f"rawtcp broadcaster: 1 sender -> {args.receivers} receivers, {args.duration:g} s "
        f"(ring {args.capacity_mib} MiB, recv chunk {args.recv_chunk_kib} KiB, {os.cpu_count()} CPUs)"
    )
    ours = run_broadcaster(config, args.receivers, args.duration, args.warmup)
    gw = ours["gateway_stats"]
    print(f"  gateway loop: {ours['gateway_loop']}")
    print(f"  sender -> gateway: {ours['sender_rate_gbps']:.2f} Gbit/s")
    print(
        f"  aggregate receiver throughput: {ours['aggregate_gbps']:.2f} Gbit/s "
        f"(per receiver {ours['per_receiver_gbps_min']:.2f}..{ours['per_receiver_gbps_max']:.2f})"
    )
    print(
        f"  sender pauses: {gw['sender_recv_pause_count']} ({gw['sender_recv_pause_ns'] / 1e9:.2f} s), "
        f"lag disconnections: {gw['disconnections_lag']}, receivers lost: {ours['receivers_disconnected']}"
    )
    summary: dict[str, Any] = {"broadcaster": {k: v for k, v in ours.items() if k != "gateway_stats"}, "gateway_stats": gw}

    if not args.no_iperf:
        iperf3 = ensure_iperf3(args.install)
        if iperf3 is None:
            print("  iperf3: not found (Debian package iperf3; run with --install to install it)")
        else:
            try:
                ref = run_iperf3(iperf3, args.receivers, args.duration)
            except Exception as exc:  # report, do not fail the broadcaster figures
                print(f"  iperf3: failed: {exc}")
            else:
                ratio = ours["aggregate_gbps"] / ref["aggregate_gbps"] if ref["aggregate_gbps"] else 0.0
                print(f"  iperf3 {ref['version']} -P {args.receivers} loopback aggregate: {ref['aggregate_gbps']:.2f} Gbit/s")
                print(f"  ratio broadcaster / iperf3: {ratio:.3f}")
                summary["iperf3"] = ref
                summary["ratio"] = round(ratio, 4)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
