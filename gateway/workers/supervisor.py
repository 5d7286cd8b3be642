"""`server.workers = N`: N gateway processes on one port, one topic space through the broker
(docs/cluster.md §5).

The supervisor (this module, in the process `gateway serve` started) fixes the ports first (a port 0 is
resolved once, by binding it with SO_REUSEPORT and holding it until every worker listens) and the admin
token (generated once, so every worker accepts the same), then forks the workers. Each worker is a whole
gateway (`start_gateway(config, worker=i)`) that binds the same HTTP and ingest ports with SO_REUSEPORT;
worker 0 alone runs the raw TCP broadcaster. Each worker also gets its inbox and the others' (socketpairs
made here, reachable by no other process), for the session requests that reach the wrong worker
(forward.py), and the shared counters of the per-address limits (gateway/edge/addrcount.py). The supervisor writes
the ready file once all of them listen, forwards SIGTERM and SIGINT, and when one worker ends it stops the
others and exits non-zero, so whatever supervises the gateway restarts it whole.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import GatewayConfig
from ..edge.addrcount import SharedCounts
from ..ops import logformat
from .forward import WorkerLinks, make_inbox, new_key

#: Seconds for every worker to listen (a cold start imports the app; Redis may take its connect timeout).
READY_TIMEOUT_S = 60.0


def _reserve(host: str) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket on a free port: the port every worker then binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock


def run_workers(
    config: GatewayConfig, ready_file: str | None,
    serve: Callable[[GatewayConfig, str, int, WorkerLinks], int], write_ready_file: Callable[[str, dict[str, Any]], None],
) -> int:
    """Fork `config.server.workers` processes running `serve(config, worker_ready_file, index, links)`;
    return the exit status once they are gone."""
    raw = copy.deepcopy(config.raw)
    holders = []
    if raw["server"]["port"] == 0:
        holders.append(_reserve(config.server.host))
        raw["server"]["port"] = holders[-1].getsockname()[1]
    if config.ingest.enabled and raw["ingest"]["port"] == 0:
        holders.append(_reserve(config.ingest.host))
        raw["ingest"]["port"] = holders[-1].getsockname()[1]
    generated = not raw["server"]["admin_token"]
    if generated:  # printed once, here, before any worker says it listens
        raw["server"]["admin_token"] = secrets.token_urlsafe(18)
        logformat.say(f"admin token (development, loopback only): {raw['server']['admin_token']}")
    shared = GatewayConfig(raw)
    workdir = Path(tempfile.mkdtemp(prefix="gateway-workers-"))
    # One inbox per worker, made before any worker starts (a connection passed early waits in it until the
    # owner serves): session requests that reach the wrong worker go there (forward.py). Only the workers
    # hold its ends: no other process can reach a worker this way.
    inboxes = [make_inbox() for _ in range(config.server.workers)]
    counts = SharedCounts(config.server.workers)
    key = new_key()
    pids: list[int] = []
    for index in range(config.server.workers):
        pid = os.fork()
        if pid == 0:  # the worker
            for sock in holders + [receiving for i, (receiving, _) in enumerate(inboxes) if i != index]:
                sock.close()
            inboxes[index][1].close()  # its own: it never forwards to itself
            outboxes = tuple(None if i == index else sending for i, (_, sending) in enumerate(inboxes))
            code = 1
            try:
                code = serve(shared, str(workdir / f"worker-{index}.json"), index,
                             WorkerLinks(index, outboxes, inboxes[index][0], key, counts))
            except BaseException:  # os._exit below would end the worker without saying why
                logformat.say_exception(f"gateway worker {index}: ended by an exception:")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    for pair in inboxes:  # the workers hold them: a dead worker's inbox then refuses instead of queueing
        for sock in pair:
            sock.close()

    asked_to_stop: list[int] = []  # the signals forwarded: a worker they end has stopped cleanly

    def forward(signum: int, _frame: object) -> None:
        asked_to_stop.append(signum)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    ready, start_failure = _wait_ready(workdir, pids)
    for sock in holders:
        sock.close()
    if ready is not None:
        info = {**ready, "workers": pids}
        if generated:
            info["admin_token"] = shared.server.admin_token
        if ready_file:
            write_ready_file(ready_file, info)
        logformat.say(f"gateway: {len(pids)} workers on http://{config.server.host}:{ready['http_port']}")
    code = _supervise(pids, asked_to_stop, stopping=ready is None)
    if ready is None:  # the gateway did not start: as one process would, 2 when a worker said it could not
        code = 2 if start_failure == 2 else 1
    for path in workdir.iterdir():
        path.unlink()
    workdir.rmdir()
    return code


def _wait_ready(workdir: Path, pids: list[int]) -> tuple[dict[str, Any] | None, int | None]:
    """Worker 0's ports once every worker listens; else None (the others stopped) and the exit status of the
    worker that ended during start-up (None when the time ran out)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    paths = [workdir / f"worker-{i}.json" for i in range(len(pids))]
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            info: dict[str, Any] = json.loads(paths[0].read_text())
            info.pop("admin_token", None)
            return info, None
        for index, pid in enumerate(pids):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                code = os.waitstatus_to_exitcode(status)
                logformat.say(f"gateway: worker {index} (pid {pid}) ended during start-up with status {code}: stopping"
                              " the others", stream=sys.stderr, level=logging.ERROR)
                pids.remove(pid)
                _stop(pids)
                return None, code
        time.sleep(0.05)
    logformat.say("gateway: the workers did not all start in time", stream=sys.stderr, level=logging.ERROR)
    _stop(pids)
    return None, None


def _stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _supervise(pids: list[int], asked_to_stop: list[int], stopping: bool = False) -> int:
    """Wait for the workers; the first one to end takes the others down (`stopping`: they were told to stop
    already). Returns the exit status: 0 when every worker ended cleanly, or by the signal the supervisor
    forwarded (uvicorn stops gracefully, then raises the signal again so the process ends by it)."""
    code = 0 if pids else 1
    while pids:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in pids:
            continue
        pids.remove(pid)
        worker_code = os.waitstatus_to_exitcode(status)
        if not stopping:
            stopping = True
            if worker_code != 0 and -worker_code not in asked_to_stop:
                logformat.say(f"gateway: worker {pid} ended with status {worker_code}: stopping the others",
                              stream=sys.stderr, level=logging.ERROR)
                code = 1
            _stop(pids)
    return code
