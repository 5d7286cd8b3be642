"""Rounds across the partitions of one micro-batch, for the feed's ``--lockstep`` spread mode.

Why not Spark's own ``BarrierTaskContext.allGather``: it polls its RPC once a second, so a round costs ~1 s
(measured 0.85-0.95 s on local[2]), which would cap a 500-line chunk round at ~1,000 records/s. Here the
driver runs a tiny TCP coordinator for the duration of the batch and each task keeps one connection to it:
a round costs a loopback round trip. The batch still runs as a barrier stage, only so that Spark schedules
all its tasks at once (a task waiting for a partner that is never scheduled would hang) and kills them all
when one fails.

Line protocol, one connection per task: the task writes ``ROUND MORE\\n`` (``MORE`` 1 when it still has
records after this round) and reads ``1\\n`` (another round follows) or ``0\\n`` (every task is done) once
every task wrote the same round, or ``E\\n`` when a task went away before the end: the coordinator is then
broken for good and every task of the batch fails. Spark's retry of the barrier stage fails the same way, so
the batch fails and the query stops; restarted, it replays the batch, which is idempotent with explicit seqs.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections import defaultdict

__all__ = ["RoundClient", "RoundCoordinator"]


class RoundCoordinator:
    """Driver side: releases a round when all ``parties`` tasks reached it. Use as a context manager."""

    def __init__(self, parties: int, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.parties = parties
        self.timeout = timeout
        self._cond = threading.Condition()
        #: round -> [tasks arrived, any of them has more]
        self._rounds: dict[int, list] = defaultdict(lambda: [0, False])
        self.broken = False
        coordinator = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                finished = False
                try:
                    self.connection.settimeout(coordinator.timeout)
                    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    for line in self.rfile:
                        round_no, more = (int(x) for x in line.split())
                        answer = coordinator._arrive(round_no, bool(more))
                        self.wfile.write(b"E\n" if answer is None else b"1\n" if answer else b"0\n")
                        finished = answer is False
                        if answer is None:
                            return
                finally:
                    if not finished:
                        coordinator._break()

        self._server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.address: tuple[str, int] = self._server.socket.getsockname()[:2]
        # shutdown() at the batch's end waits for the loop's next poll: 0.05 s, not the default 0.5 s
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="lockstep-coordinator", daemon=True
        ).start()

    def _arrive(self, round_no: int, more: bool) -> bool | None:
        """Whether another round follows, once all tasks arrived; None if broken or timed out."""
        with self._cond:
            state = self._rounds[round_no]
            state[0] += 1
            state[1] = state[1] or more
            if state[0] == self.parties:
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: state[0] >= self.parties or self.broken, self.timeout):
                self.broken = True
                self._cond.notify_all()
            return None if self.broken else state[1]

    def _break(self) -> None:
        with self._cond:
            self.broken = True
            self._cond.notify_all()

    def __enter__(self) -> RoundCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class RoundClient:
    """Task side: ``next_round(more)`` blocks until every task finished the round; True if another follows."""

    def __init__(self, address: tuple[str, int], timeout: float = 30.0) -> None:
        self._sock = socket.create_connection(address, timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one tiny line per round
        self._file = self._sock.makefile("rb")
        self._round = 0

    def next_round(self, more: bool) -> bool:
        self._sock.sendall(b"%d %d\n" % (self._round, int(more)))
        answer = self._file.readline()
        if answer not in (b"0\n", b"1\n"):
            raise ConnectionError(
                f"lockstep round {self._round} broken (answer {answer!r}): another task of this batch failed or "
                f"did not arrive in time"
            )
        self._round += 1
        return answer == b"1\n"

    def close(self) -> None:
        self._file.close()
        self._sock.close()
