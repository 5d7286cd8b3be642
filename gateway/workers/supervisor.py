"""`server.workers = N`: N gateway processes on one port, one topic space through the broker
(docs/cluster.md §5).

The supervisor (this module, in the process `gateway serve` started) fixes the ports first (a port 0 is
resolved once, by binding it with SO_REUSEPORT and holding it until every worker listens) and the admin
token (generated once, so every worker accepts the same), then forks the workers. Each worker is a whole
gateway (`start_gateway(config, worker=i)`) that binds the same HTTP and ingest ports with SO_REUSEPORT;
worker 0 alone runs the raw TCP broadcaster. Each worker also gets its inbox and the others' (socketpairs
made here, reachable by no other process), for the session requests that reach the wrong worker
(forward.py), and the shared counters of the per-address limits (gateway/edge/addrcount.py). The supervisor
writes the ready file once all of them listen and forwards SIGTERM and SIGINT (every worker drains).

Workers survive each other. The supervisor keeps both ends of every inbox, so that a worker that dies (any
end the supervisor did not ask for: a crash, kill -9, even a clean exit) is forked again with the same index
on the same inbox, which its siblings still hold the sending end of: they need nothing new. Until the new
one runs, the supervisor empties the dead worker's inbox (closing each connection passed to it, so a forward
fails at once instead of waiting), and it zeroes the dead worker's column of per-address counts (its
connections are gone; the token buckets keep what was taken). Worker 0 comes back with the raw TCP ports
it had (a port 0 is fixed to the one it got first). The first restart is at once; each further death in a
row within STABLE_S of the worker's start waits twice as long as the one before, from RESTART_DELAY_MIN_S
up to RESTART_DELAY_MAX_S; one line is logged per death. A worker that dies before it listens
MAX_START_FAILURES times in a row (a port taken meanwhile, the broker unreachable at its start) ends the
gateway: the others drain and the supervisor exits 1. Before every worker first listened, as before, one
ending stops the others (status 2 when it said it could not start, else 1). SIGTERM and SIGINT cancel any
restart that waits, and no worker is forked from then on.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import select
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from ..config import GatewayConfig
from ..edge.addrcount import SharedCounts
from ..ops import logformat
from .forward import WorkerLinks, make_inbox, new_key

#: Seconds for every worker to listen (a cold start imports the app; Redis may take its connect timeout).
READY_TIMEOUT_S = 60.0
#: Seconds before the second restart of a worker in a row; each further one waits twice as long, up to
#: RESTART_DELAY_MAX_S (the first restart is at once).
RESTART_DELAY_MIN_S = 0.5
RESTART_DELAY_MAX_S = 10.0
#: A worker that stayed up this long had recovered: its next death restarts it at once again.
STABLE_S = 30.0
#: Restarts in a row whose worker died before it listened, after which the supervisor stops the gateway (1).
MAX_START_FAILURES = 5
#: Seconds between two looks for a restarted worker's ports file (it listens), while one is starting.
LISTEN_POLL_S = 0.05
#: The signals the supervisor handles; blocked while it forks, so a new worker never runs its handlers.
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
#: file descriptors read from a dead worker's inbox at once
_FDS_PER_READ = 16


def _reserve(host: str) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket on a free port: the port every worker then binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock


def restart_delay(deaths: int) -> float:
    """Seconds to wait before forking a worker again after `deaths` deaths in a row (each within STABLE_S
    of its start): 0 after the first, then RESTART_DELAY_MIN_S doubling up to RESTART_DELAY_MAX_S."""
    if deaths <= 1:
        return 0.0
    return min(RESTART_DELAY_MIN_S * 2.0 ** (deaths - 2), RESTART_DELAY_MAX_S)


def describe_status(status: int) -> str:
    """A wait status as a log line says it: `killed by SIGKILL`, `ended with status 1`."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"killed by {name}"
    return f"ended with status {os.waitstatus_to_exitcode(status)}"


@dataclass
class _Worker:
    """One worker index and the process that serves it now."""

    index: int
    #: the live process, None while it waits to be forked again
    pid: int | None = None
    #: time.monotonic() of the fork
    started: float = 0.0
    #: the supervisor looks for its ports file (a restarted worker, until it listens or READY_TIMEOUT_S passed)
    watching: bool = False
    #: deaths in a row, each within STABLE_S of its start (restart_delay)
    deaths: int = 0
    #: restarts in a row whose process died before it listened
    start_failures: int = 0
    #: when to fork it again (time.monotonic()), while pid is None
    restart_at: float | None = None
    #: the previous process and when it died: for the line saying it serves again
    died: tuple[int, float] | None = None


def run_workers(
    config: GatewayConfig,
    ready_file: str | None,
    serve: Callable[[GatewayConfig, str, int, WorkerLinks], int],
    write_ready_file: Callable[[str, dict[str, Any]], None],
) -> int:
    """Fork `config.server.workers` processes running `serve(config, worker_ready_file, index, links)`, fork
    again each one that dies, and return the exit status once they are gone (module docstring)."""
    return _Supervisor(config, serve).run(ready_file, write_ready_file)


class _Supervisor:
    def __init__(self, config: GatewayConfig, serve: Callable[[GatewayConfig, str, int, WorkerLinks], int]) -> None:
        self.config = config
        self.serve = serve
        self.raw = copy.deepcopy(config.raw)
        self.holders: list[socket.socket] = []
        if self.raw["server"]["port"] == 0:
            self.holders.append(_reserve(config.server.host))
            self.raw["server"]["port"] = self.holders[-1].getsockname()[1]
        if config.ingest.enabled and self.raw["ingest"]["port"] == 0:
            self.holders.append(_reserve(config.ingest.host))
            self.raw["ingest"]["port"] = self.holders[-1].getsockname()[1]
        self.generated = not self.raw["server"]["admin_token"]
        if self.generated:  # printed once, here, before any worker says it listens
            self.raw["server"]["admin_token"] = secrets.token_urlsafe(18)
            logformat.say(f"admin token (development, loopback only): {self.raw['server']['admin_token']}")
        self.shared = GatewayConfig(self.raw)
        self.workdir = Path(tempfile.mkdtemp(prefix="gateway-workers-"))
        # One inbox per worker, made before any worker starts (a connection passed early waits in it until the
        # owner serves): session requests that reach the wrong worker go there (forward.py). Only the workers
        # and this supervisor hold its ends: no other process can reach a worker this way. The supervisor
        # keeps them for the worker it forks again in place of a dead one.
        self.inboxes = [make_inbox() for _ in range(config.server.workers)]
        self.counts = SharedCounts(config.server.workers)
        self.key = new_key()
        self.workers = [_Worker(i) for i in range(config.server.workers)]
        #: the signals forwarded: a worker they end has stopped cleanly; none is forked once there is one
        self.asked_to_stop: list[int] = []
        #: no more forks: a signal asked to stop, or the supervisor gave up on a worker
        self.stopping = False
        #: the exit status is 1: a worker failed (gave up on it, or one ended badly during the stop)
        self.failed = False
        #: the signals sent to the workers to stop them: a worker one of them ends has stopped cleanly
        self.stop_signals: set[int] = set()
        self.previous: dict[int, Any] = {}
        self.wake_r, self.wake_w = os.pipe()  # signal.set_wakeup_fd: a signal ends the supervisor's wait

    # -- the whole run -----------------------------------------------------------------------------------

    def run(self, ready_file: str | None, write_ready_file: Callable[[str, dict[str, Any]], None]) -> int:
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.previous = {signum: signal.getsignal(signum) for signum in _HANDLED}
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        signal.signal(signal.SIGCHLD, _ignore)  # a handler, so that the death of a worker wakes the wait
        old_wakeup = signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        try:
            for worker in self.workers:
                self._fork(worker)
            ready, start_failure = self._wait_ready()
            for sock in self.holders:
                sock.close()
            if ready is None:  # the gateway did not start: as one process would, 2 when a worker said it could not
                self._wait_all()
                return 2 if start_failure == 2 else 1
            self._fix_raw_ports(ready)
            pids = [worker.pid for worker in self.workers]
            info = {**ready, "workers": pids}
            if self.generated:
                info["admin_token"] = self.shared.server.admin_token
            if ready_file:
                write_ready_file(ready_file, info)
            logformat.say(f"gateway: {len(pids)} workers on http://{self.config.server.host}:{ready['http_port']}")
            self._supervise()
            return 1 if self.failed else 0
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for signum, handler in self.previous.items():
                if handler is not None:
                    signal.signal(signum, handler)
            for pair in self.inboxes:
                for sock in pair:
                    sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for path in self.workdir.iterdir():
                path.unlink()
            self.workdir.rmdir()

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.asked_to_stop.append(signum)
        self.stop_signals.add(signum)
        for worker in self.workers:
            if worker.pid is not None:
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:
                    pass

    def _ports_file(self, index: int) -> Path:
        return self.workdir / f"worker-{index}.json"

    def _fix_raw_ports(self, ready: dict[str, Any]) -> None:
        """A raw TCP port 0 becomes the one worker 0 got: a restarted worker 0 listens where its clients were."""
        rawtcp = self.raw.get("rawtcp", {})
        if not self.config.rawtcp.enabled:
            return
        changed = False
        for key, got in (("sender_port", ready.get("raw_sender_port")), ("receiver_port", ready.get("raw_receiver_port"))):
            if rawtcp.get(key) == 0 and got:
                rawtcp[key] = got
                changed = True
        if changed:
            self.shared = GatewayConfig(self.raw)

    # -- forking -----------------------------------------------------------------------------------------

    def _fork(self, worker: _Worker) -> None:
        self._ports_file(worker.index).unlink(missing_ok=True)
        # blocked until the child has put back the handlers it inherits: it never forwards a signal itself
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        try:
            if self.asked_to_stop:  # a stop came in since the restart was decided
                self._begin_stop()
                return
            pid = os.fork()
            if pid == 0:
                self._child(worker.index, mask)
            worker.pid, worker.started, worker.restart_at = pid, time.monotonic(), None
            worker.watching = worker.died is not None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _child(self, index: int, mask: set[int | signal.Signals]) -> NoReturn:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for signum, handler in self.previous.items():
                if handler is not None:
                    signal.signal(signum, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(self.wake_r)
            os.close(self.wake_w)
            for sock in self.holders + [receiving for i, (receiving, _) in enumerate(self.inboxes) if i != index]:
                sock.close()
            self.inboxes[index][1].close()  # its own: it never forwards to itself
            outboxes = tuple(None if i == index else sending for i, (_, sending) in enumerate(self.inboxes))
            code = self.serve(
                self.shared,
                str(self._ports_file(index)),
                index,
                WorkerLinks(index, outboxes, self.inboxes[index][0], self.key, self.counts),
            )
        except BaseException:  # os._exit below would end the worker without saying why
            logformat.say_exception(f"gateway worker {index}: ended by an exception:")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    # -- start-up ----------------------------------------------------------------------------------------

    def _wait_ready(self) -> tuple[dict[str, Any] | None, int | None]:
        """Worker 0's ports once every worker listens; else None (the others told to stop) and the exit status
        of the worker that ended during start-up (None when the time ran out)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        paths = [self._ports_file(w.index) for w in self.workers]
        while time.monotonic() < deadline:
            if all(p.exists() for p in paths):
                info: dict[str, Any] = json.loads(paths[0].read_text())
                info.pop("admin_token", None)
                return info, None
            for worker in self.workers:
                if worker.pid is None:  # not forked: a signal came in first
                    self._stop_all()
                    return None, None
                ended, status = os.waitpid(worker.pid, os.WNOHANG)
                if ended:
                    code = os.waitstatus_to_exitcode(status)
                    logformat.say(
                        f"gateway: worker {worker.index} (pid {worker.pid}) ended during start-up with"
                        f" status {code}: stopping the others",
                        stream=sys.stderr,
                        level=logging.ERROR,
                    )
                    worker.pid = None
                    self._stop_all()
                    return None, code
            time.sleep(0.05)
        logformat.say("gateway: the workers did not all start in time", stream=sys.stderr, level=logging.ERROR)
        self._stop_all()
        return None, None

    def _begin_stop(self) -> None:
        """No more forks; a restart still waiting is cancelled."""
        self.stopping = True
        for worker in self.workers:
            worker.restart_at = None

    def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains), and no more forks."""
        self._begin_stop()
        self.stop_signals.add(signal.SIGTERM)
        for worker in self.workers:
            if worker.pid is not None:
                try:
                    os.kill(worker.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _wait_all(self) -> None:
        while any(w.pid is not None for w in self.workers):
            try:
                pid, _status = os.wait()
            except ChildProcessError:
                return
            for worker in self.workers:
                if worker.pid == pid:
                    worker.pid = None

    # -- serving -----------------------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Until every worker is gone for good: reap, fork again when due, and wait (for a signal, a death,
        the next restart, or a connection passed to a dead worker's inbox), never spinning."""
        while True:
            self._reap()
            if self.asked_to_stop:  # the others drain; a restart still waiting is cancelled
                self._begin_stop()
            if self.stopping and all(w.pid is None for w in self.workers):
                return
            now = time.monotonic()
            for worker in self.workers:
                if not self.stopping and worker.pid is None and worker.restart_at is not None and worker.restart_at <= now:
                    self._drain_inbox(worker.index)
                    self._fork(worker)
            waits = [w.restart_at - now for w in self.workers if w.pid is None and w.restart_at is not None]
            if any(w.pid is not None and w.watching for w in self.workers):
                waits.append(LISTEN_POLL_S)
            dead = [self.inboxes[w.index][0].fileno() for w in self.workers if w.pid is None]
            try:
                readable, _, _ = select.select([self.wake_r, *dead], [], [], max(0.0, min(waits)) if waits else None)
            except InterruptedError:  # pragma: no cover (PEP 475 retries; a handler raising would land here)
                continue
            if self.wake_r in readable:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            for worker in self.workers:
                if worker.pid is None and self.inboxes[worker.index][0].fileno() in readable:
                    self._drain_inbox(worker.index)

    def _reap(self) -> None:
        self._look_for_listening(time.monotonic())  # first: a worker may have listened just before it died
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for worker in self.workers:
                if worker.pid == pid:
                    self._died(worker, status)
                    break

    def _died(self, worker: _Worker, status: int) -> None:
        assert worker.pid is not None
        pid, now = worker.pid, time.monotonic()
        worker.pid = None
        # its connections are gone: what it counted per address must not hold its siblings' clients back
        column = self.counts.columns[worker.index].cast("B")
        column[:] = bytes(len(column))
        self._drain_inbox(worker.index)
        code = os.waitstatus_to_exitcode(status)
        if self.asked_to_stop or self.stopping:
            if code != 0 and -code not in self.stop_signals:
                self.failed = True
                logformat.say(
                    f"gateway: worker {worker.index} (pid {pid}) {describe_status(status)} during the stop",
                    stream=sys.stderr,
                    level=logging.ERROR,
                    index=worker.index,
                    pid=pid,
                    status=code,
                )
            return
        uptime = now - worker.started
        listened = self._ports_file(worker.index).exists()  # written once it listens (unlinked before the fork)
        worker.deaths = worker.deaths + 1 if uptime < STABLE_S else 1
        worker.start_failures = 0 if listened else worker.start_failures + 1
        what = f"gateway: worker {worker.index} (pid {pid}) {describe_status(status)} after {uptime:.2f} s"
        if not listened:
            what += f", before it listened ({worker.start_failures} of {MAX_START_FAILURES} in a row)"
        fields: dict[str, Any] = {"index": worker.index, "pid": pid, "status": code, "uptime_s": round(uptime, 3)}
        if worker.start_failures >= MAX_START_FAILURES:
            logformat.say(f"{what}: stopping the gateway", stream=sys.stderr, level=logging.ERROR, **fields)
            self.failed = True
            self._stop_all()
            return
        delay = restart_delay(worker.deaths)
        worker.restart_at, worker.died = now + delay, (pid, now)
        logformat.say(
            f"{what}: restarting it {'now' if delay == 0 else f'in {delay:g} s'}",
            stream=sys.stderr,
            level=logging.ERROR,
            restart_in_s=delay,
            **fields,
        )

    def _look_for_listening(self, now: float) -> None:
        for worker in self.workers:
            if worker.pid is None or not worker.watching:
                continue
            if self._ports_file(worker.index).exists():
                worker.watching = False
                since = f", {now - worker.died[1]:.2f} s after pid {worker.died[0]} died" if worker.died else ""
                logformat.say(
                    f"gateway: worker {worker.index} serving again (pid {worker.pid}){since}", index=worker.index, pid=worker.pid
                )
            elif now - worker.started >= READY_TIMEOUT_S:
                worker.watching = False  # no more looking; it is left to run (a death is handled as any other)
                logformat.say(
                    f"gateway: worker {worker.index} (pid {worker.pid}) does not listen {READY_TIMEOUT_S:g} s after its restart",
                    stream=sys.stderr,
                    level=logging.WARNING,
                )

    def _drain_inbox(self, index: int) -> None:
        """Close every connection passed to a dead worker (its forwarder sees the end at once)."""
        inbox = self.inboxes[index][0]
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(inbox, 1, _FDS_PER_READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            for fd in fds:
                os.close(fd)
            if not data and not fds:
                return


def _ignore(_signum: int, _frame: FrameType | None) -> None:
    """SIGCHLD's handler: nothing to do, the wakeup fd has woken the supervisor."""
