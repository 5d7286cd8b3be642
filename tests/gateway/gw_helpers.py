"""Clients for gateway tests: real sockets on loopback, bounded waits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import orjson
from websockets.sync.client import connect

from fanout_client.ingest import BadAnswer, Closed, IngestConnection
from tests import web


def ws_connect(gw, *, query: str = "", rcvbuf: int | None = None, max_queue: int | None = None):
    sock = None
    if rcvbuf is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", gw.http_port))
    # max_queue=None (unbounded): a test that stops reading must not stall the close handshake for 10 s;
    # a client meant to stall passes a bound, so its reader stops and the kernel buffers fill. Its close
    # handshake then waits behind the unread frames (the gateway may have cut it long before): 1 s, not 10
    return connect(
        gw.ws_url + query,
        sock=sock,
        open_timeout=5,
        max_size=None,
        max_queue=max_queue,
        compression=None,
        close_timeout=10 if max_queue is None else 1,
    )


def send(ws, **command) -> None:
    ws.send(json.dumps(command))


def recv_entries(ws, timeout: float = 5.0) -> list[dict]:
    frame = ws.recv(timeout=timeout)
    entries = orjson.loads(frame)
    assert isinstance(entries, list)
    return entries


def collect(ws, until, timeout: float = 5.0) -> list[dict]:
    """Receive entries until `until(entries_so_far)` is true; fail after `timeout` seconds."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; got {got[-5:]}"
        got += recv_entries(ws, remaining)
    return got


def wait_for(predicate, what: str = "condition", timeout: float = 10.0):
    """The first true value of `predicate()`, tried every 50 ms; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metric(gw, name: str) -> float:
    """One unlabelled sample of /metrics, by its exposed name (a counter's ends in `_total`)."""
    for line in web.get(f"{gw.http_url}/metrics", timeout=10, trust_env=False).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def auth(gw) -> dict:
    return {"Authorization": f"Bearer {gw.admin_token}"}


class Ingest:
    """A TCP ingest publisher (fanout_client.ingest) whose answers are dicts, as the tests compare them."""

    def __init__(self, gw):
        self.connection = IngestConnection("127.0.0.1", gw.ingest_port, timeout=5)

    def send(self, *records) -> None:
        self.connection.send(*records)

    def send_raw(self, data: bytes) -> None:
        self.connection.write(data)

    def has_line(self, timeout: float) -> bool:
        """Whether an answer arrives within `timeout` seconds (without consuming it)."""
        return self.connection.poll(timeout)

    def readline(self) -> dict:
        answer = self.connection.next_answer()
        assert not isinstance(answer, (Closed, BadAnswer)), f"no answer: {answer!r}"
        return msgspec.to_builtins(answer)

    def sync(self, sync_id=1) -> dict:
        """The `synced` answer; error answers before it are skipped (kept in `connection.errors`)."""
        return msgspec.to_builtins(self.connection.sync(sync_id))

    def close(self):
        self.connection.close()


ROOT = Path(__file__).resolve().parents[2]


def serve_process(
    tmp_path: Path, config_text: str, *, piped: bool = False, timeout: float = 30.0
) -> tuple[subprocess.Popen[Any], dict[str, Any]]:
    """`python -m gateway serve --config` of this checkout (no `GATEWAY_*` variable of ours reaches it), once it is
    ready: the process and its ready file's values (`http_port`...). Its output goes to tmp_path/gateway.log,
    or with `piped` to a text pipe the caller reads (`proc.communicate`). The caller stops it."""
    config, ready, log = tmp_path / "gateway.toml", tmp_path / "ready.json", tmp_path / "gateway.log"
    config.write_text(config_text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file", str(ready)]
    if piped:
        proc: subprocess.Popen[Any] = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    else:
        with open(log, "ab") as out:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output() -> str:
        return proc.communicate()[0] if piped else log.read_text()[-2000:]

    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, output()
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the gateway did not start: {output()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())
