"""Real processes for the cluster tests: redis-server and `python -m gateway serve` (so kill -9 is real)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.sync.client import connect

from loadtest.redisproc import RedisProcess
from tests.gateway.gw_helpers import collect as gw_collect
from tests.gateway.gw_helpers import send

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "cluster-test-token"
_clients = threading.local()


def http() -> httpx.Client:
    """This thread's HTTP client. Every request still goes over a new connection (as with `httpx.post`: the kernel
    spreads them over a node's workers), without the ~30 ms of CPU that making a client for each request costs."""
    client = getattr(_clients, "client", None)
    if client is None:
        limits = httpx.Limits(max_keepalive_connections=0)
        client = _clients.client = httpx.Client(timeout=10, limits=limits, headers={"connection": "close"})
    return client


class RedisServer(RedisProcess):
    """redis-server on a free loopback port, no persistence unless asked; restartable on the same port
    (loadtest/redisproc.py, which the chaos run and the cluster benchmark use too)."""


class Node:
    """One gateway process on the Redis."""

    def __init__(self, workdir: Path, redis_url: str, sections: dict[str, dict[str, Any]]) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.sections = sections
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def config_text(self) -> str:
        sections: dict[str, dict[str, Any]] = {
            # drain_timeout_s: a SIGTERM (`stop`) drains for at most 1 s, not the default 10, for the clients a
            # test leaves open (an abandoned long-poll session would hold the drain to its end; with nothing
            # left open it ends at once). The drain tests set their own (test_drain_workers.py)
            "server": {
                "host": "127.0.0.1",
                "port": 0,
                "admin_token": TOKEN,
                "log_level": "warning",
                "max_connections_per_ip": 0,
                "drain_timeout_s": 1.0,
            },
            "ingest": {"port": 0},
            "rawtcp": {"enabled": False},
            "broker": {"url": self.redis_url, "connect_timeout_s": 5.0},
        }
        for name, values in self.sections.items():
            if name != "rule":  # `rule`: settings added to the one topic rule below
                sections.setdefault(name, {}).update(values)
        lines = []
        for name, values in sections.items():
            lines.append(f"[{name}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        lines += [
            "[[topics.rules]]",
            'pattern = "*"',
            'kind = "ring"',
            "capacity = 16",
            "anonymous = true",
            "client_publish = true",
        ]
        lines += [f"{key} = {json.dumps(value)}" for key, value in self.sections.get("rule", {}).items()]
        return "\n".join(lines) + "\n"

    def start(self, wait: bool = True) -> "Node":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "gateway.toml"
        config.write_text(self.config_text())
        ready = self.workdir / "ready.json"
        ready.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file", str(ready)],
            cwd=ROOT,
            env=env,
            stdout=open(self.workdir / "gateway.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: `kill_group` ends its workers with it
        )
        if wait:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway ended with {self.proc.returncode}: {self.log()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not start: {self.log()[-2000:]}")
                time.sleep(0.05)
            self.info = json.loads(ready.read_text())
        return self

    def log(self) -> str:
        path = self.workdir / "gateway.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.info['http_port']}/ws"

    @property
    def ingest_port(self) -> int:
        return int(self.info["ingest_port"])

    def kill_group(self) -> None:
        """kill -9 the gateway and every worker it forked (its process group), if it still runs (then the group is
        surely its own, not a reused number's)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)

    def stop(self, signalled: bool = False) -> int | None:
        """SIGTERM (unless `signalled`: sent already), then the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        if not signalled:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    # -- clients ---------------------------------------------------------------------------------------

    def publish(self, topic: str, data: Any, **extra: Any) -> httpx.Response:
        return http().post(
            f"{self.http_url}/api/topics/{topic}/publish",
            json={"data": data, **extra},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )

    def api(self, path: str) -> Any:
        reply = http().get(f"{self.http_url}/api{path}", headers={"Authorization": f"Bearer {TOKEN}"})
        reply.raise_for_status()
        return reply.json()

    def ws(self):
        return connect(self.ws_url, open_timeout=5, max_size=None, compression=None)


class NodeFactory:
    def __init__(self, tmp_path: Path, redis: RedisServer) -> None:
        self.tmp_path = tmp_path
        self.redis = redis
        self.nodes: list[Node] = []

    def start(self, name: str, wait: bool = True, **sections: dict[str, Any]) -> Node:
        node = Node(self.tmp_path / name, self.redis.url, sections)
        self.nodes.append(node)
        return node.start(wait)

    def stop_all(self) -> None:
        """kill -9 every node with its workers: a drain after the test checks nothing and costs a start's time
        (the tests of a clean stop stop their node themselves and assert its exit status)."""
        for node in self.nodes:
            node.kill_group()


def collect(ws, until, timeout: float = 10.0) -> list[dict]:
    """gw_helpers.collect, with the cluster tests' longer default wait (messages cross Redis)."""
    return gw_collect(ws, until, timeout)


def subscribe(ws, topic: str, since: tuple[str, int] | None = None) -> dict:
    """Subscribe and return the `subscribed` entry (entries after it stay unread: use `collect`)."""
    command: dict[str, Any] = {"op": "subscribe", "topic": topic, "id": topic}
    if since is not None:
        command["since"] = {"epoch": since[0], "seq": since[1]}
    send(ws, **command)
    pending: list[dict] = []

    def done(got: list[dict]) -> bool:
        return any(e["type"] in ("subscribed", "error") and e.get("id") == topic for e in got)

    got = collect(ws, done)
    entry = next(e for e in got if e.get("id") == topic)
    assert entry["type"] == "subscribed", entry
    pending += got[got.index(entry) + 1 :]
    ws.pending = pending  # entries that came in the same frame
    return entry


def messages(ws, topic: str, until, timeout: float = 10.0) -> list[dict]:
    """`msg` and `loss` entries of `topic` (those left by `subscribe` first) until `until(entries)`."""
    got = [e for e in getattr(ws, "pending", []) if e.get("topic") == topic and e["type"] in ("msg", "loss")]
    ws.pending = []
    deadline = time.monotonic() + timeout
    while not until(got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; got {got[-6:]}"
        got += [
            e
            for e in orjson.loads(ws.recv(timeout=remaining))
            if e.get("topic") == topic and e["type"] in ("msg", "loss", "subscribed")
        ]
    return got


@contextlib.contextmanager
def topology_nodes(tmp_path: Path, broker: dict[str, Any], jwt_secret: str) -> Iterator[Callable[..., Node]]:
    """`start(name, kind=Node)` starts a gateway process on a Redis topology's `[broker]` keys (Sentinel,
    Cluster); every one started is killed at the end (as `NodeFactory.stop_all`)."""
    started: list[Node] = []

    def start(name: str, kind: type[Node] = Node) -> Node:
        node = kind(tmp_path / name, "", {"broker": broker, "auth": {"jwt_secret": jwt_secret}})
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill_group()
