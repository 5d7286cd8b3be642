"""What the flood scripts of issue 24 (`loadtest.byte_floods`, `loadtest.edge_floods`, `loadtest.topic_floods`)
share: a gateway process of their own, its RSS and CPU time read from /proc, the /healthz prober that opens a
fresh connection from 127.0.0.2 (so per-address limits of the attackers' 127.0.0.1 are not its own), and the
sampler that reports another client's /healthz delay (p50, p99, max) and the gateway's RSS growth."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.procstat import read_stat

ROOT = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "flood-admin-token"
#: the prober's source address: not the attackers' (127.0.0.1)
PROBER_ADDRESS = "127.0.0.2"


# -- the gateway's process ---------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float, int]:
    stat = read_stat(pid)
    if stat is None:
        raise RuntimeError(f"the gateway (pid {pid}) exited")
    return stat


def rss_mib(pid: int) -> float:
    return _stat(pid)[2] / 2**20


def cpu_s(pid: int) -> float:
    return _stat(pid)[1]


class FloodGateway:
    """``python -m gateway serve`` of the checkout ``root`` in ``workdir``: loopback, ephemeral ports, the
    admin token `ADMIN_TOKEN`, warnings only, no raw TCP; ``sections`` adds to (or overrides) that config, and
    ``rules`` (topic rules) replace the shipped ones."""

    def __init__(
        self,
        workdir: Path,
        sections: dict[str, dict[str, Any]] | None = None,
        *,
        root: Path = ROOT,
        timeout: float = 60.0,
        rules: list[dict[str, Any]] | None = None,
    ) -> None:
        config: dict[str, dict[str, Any]] = {
            "server": {"host": "127.0.0.1", "port": 0, "admin_token": ADMIN_TOKEN, "log_level": "warning"},
            "ingest": {"port": 0},
            "rawtcp": {"enabled": False},
        }
        for name, values in (sections or {}).items():
            config.setdefault(name, {}).update(values)
        lines = []
        for name, values in config.items():
            lines.append(f"[{name}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        for rule in rules or ():  # `[[topics.rules]]`: these replace the shipped rules
            lines.append("[[topics.rules]]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in rule.items()]
        config_file = workdir / "gateway.toml"
        config_file.write_text("\n".join(lines) + "\n")
        ready = workdir / "ready.json"
        log = workdir / "gateway.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env["PYTHONPATH"] = str(root)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(config_file), "--ready-file", str(ready)],
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not ready.exists() or not ready.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(log.read_text(errors="replace")[-2000:])
            time.sleep(0.05)
        time.sleep(0.2)
        self.info: dict[str, Any] = json.loads(ready.read_text())
        self.http_port = int(self.info["http_port"])
        self.url = f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- raw peers ---------------------------------------------------------------------------------------------


def ws_frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """A masked client frame (mask key 0: the payload goes as is)."""
    first = (0x80 if fin else 0) | opcode
    n = len(payload)
    if n < 126:
        head = bytes((first, 0x80 | n))
    elif n < 65536:
        head = struct.pack("!BBH", first, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", first, 0x80 | 127, n)
    return head + b"\0\0\0\0" + payload


def recv_until(sock: socket.socket, marker: bytes | None, size: int = 65536) -> bytes:
    """What ``sock`` receives until ``marker`` is in it or the peer closes (``marker`` None: until it closes)."""
    data = b""
    while marker is None or marker not in data:
        chunk = sock.recv(size)
        if not chunk:
            break
        data += chunk
    return data


# -- the prober --------------------------------------------------------------------------------------------


def prober_get(port: int, path: str, until: bytes | None = None) -> bytes:
    """``GET path`` on a fresh connection from `PROBER_ADDRESS`: the answer, up to ``until`` (or its end)."""
    with socket.socket() as sock:
        sock.settimeout(10)
        sock.bind((PROBER_ADDRESS, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        return recv_until(sock, until, 4096 if until else 65536)


def healthz_ms(port: int) -> float:
    """Milliseconds until /healthz answers ok on a fresh connection (inf: it did not)."""
    start = time.perf_counter()
    if b'"ok"' not in prober_get(port, "/healthz", b'"ok"'):
        return float("inf")
    return (time.perf_counter() - start) * 1000


def delay_figures(delays: list[float]) -> tuple[float, float, float]:
    """(p50, p99, max) of ``delays``."""
    ordered = sorted(delays)
    return (ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], ordered[-1])


class FloodSampler:
    """The gateway's RSS and CPU time and another client's /healthz delay, around a flood: made before the
    attackers start (20 probes, the RSS and CPU time at start), then `sample` for the flood's length, `stop`
    once it is over (peak RSS, CPU time spent), `settle` after the attackers left (RSS at the end)."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid = pid
        self.port = port
        self.before_ms = [healthz_ms(port) for _ in range(20)]
        self.rss_start = self.peak = self.rss_end = rss_mib(pid)
        self.cpu_start = cpu_s(pid)
        self.cpu = 0.0
        self.delays: list[float] = []

    def sample(self, seconds: float, interval: float = 0.05) -> None:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            self.delays.append(healthz_ms(self.port))
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(interval)

    def stop(self) -> None:
        self.peak = max(self.peak, rss_mib(self.pid))
        self.cpu = cpu_s(self.pid) - self.cpu_start

    def settle(self, seconds: float) -> None:
        time.sleep(seconds)
        self.rss_end = rss_mib(self.pid)

    def figures(self) -> dict[str, Any]:
        """``rss_mib`` (start, peak, end, peak_minus_start), ``gateway_cpu_s``, ``healthz_ms``."""
        p50, p99, worst = delay_figures(self.delays)
        return {
            "rss_mib": {
                "start": round(self.rss_start, 1),
                "peak": round(self.peak, 1),
                "end": round(self.rss_end, 1),
                "peak_minus_start": round(self.peak - self.rss_start, 1),
            },
            "gateway_cpu_s": round(self.cpu, 2),
            "healthz_ms": {
                "before_max": round(max(self.before_ms), 1),
                "probes": len(self.delays),
                "p50": round(p50, 1),
                "p99": round(p99, 1),
                "max": round(worst, 1),
            },
        }
