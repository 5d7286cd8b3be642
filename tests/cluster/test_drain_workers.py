"""Graceful drain with `server.workers` = 2 (docs/cluster.md §5): the supervisor forwards SIGTERM, every
worker closes its clients with 1012 and a reconnect hint of its own, and the supervisor exits 0 once both
workers drained."""

from __future__ import annotations

import contextlib
import re
import signal
import time

from websockets.exceptions import ConnectionClosed

HINT = re.compile(r"restarting: reconnect in (\d+) ms")


def test_every_worker_drains_and_the_supervisor_exits_0(nodes):
    node = nodes.start("w", server={"workers": 2, "log_level": "info", "drain_timeout_s": 5.0, "drain_spread_s": 2.0})
    assert len(node.info["workers"]) == 2
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(node.ws()) for _ in range(16)]  # spread over the workers by the kernel
        for ws in clients:
            ws.send('{"op": "ping", "id": 1}')
            ws.recv(timeout=5)
        assert node.proc is not None
        sent_at = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        hints = []
        for ws in clients:
            with contextlib.suppress(ConnectionClosed):
                while True:
                    ws.recv(timeout=10)
            assert ws.close_code == 1012, (ws.close_code, ws.close_reason)
            match = HINT.fullmatch(ws.close_reason or "")
            assert match, ws.close_reason
            hints.append(int(match.group(1)))
        assert node.proc.wait(15) == 0, node.log()[-3000:]
        took = time.monotonic() - sent_at
    assert took < 5.0 + 3, took
    print(
        f"\n2 workers: supervisor exited 0 {took:.2f} s after SIGTERM; hints {min(hints)}..{max(hints)} ms,"
        f" {len(set(hints))} distinct of {len(hints)}"
    )
    assert len(set(hints)) > 8 and all(0 <= h <= 2000 for h in hints), hints
    log = node.log()
    assert log.count("drained in") == 2, log[-3000:]  # each worker drained
    assert "ended with status" not in log
