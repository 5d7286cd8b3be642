"""Readiness with a broker (gateway/ops/readiness.py, the PING probe of gateway/broker/redis_broker.py): a Redis
stopped with SIGSTOP sends no error, so the gateway asks it (a PING every 2 s, 2 s to answer): /readyz
answers 503 `broker_unavailable` within 8 s of Redis stopping, and 200 again within 8 s of it answering; two
workers each answer for themselves."""

from __future__ import annotations

import os
import signal
import time

import httpx


def readyz_answers(url: str, want_status: int, timeout: float) -> tuple[float, set[int], dict]:
    """Ask /readyz (a new connection each time, as a probe does) until it answers `want_status`; the seconds
    that took, the workers seen answering it (two distinct ones are looked for), and the last body."""
    start = time.monotonic()
    workers: set[int] = set()
    body: dict = {}
    first: float | None = None
    while time.monotonic() - start < timeout:
        with httpx.Client(timeout=10) as http:  # a fresh connection: SO_REUSEPORT picks a worker each time
            reply = http.get(f"{url}/readyz")
        if reply.status_code == want_status:
            body = reply.json()
            workers.add(body["worker"])
            first = time.monotonic() - start if first is None else first
            if len(workers) == 2:
                break
        time.sleep(0.05)
    assert first is not None, f"/readyz never answered {want_status} in {timeout} s"
    return first, workers, body


def test_readyz_follows_a_stalled_redis_on_every_worker(nodes, redis_server):
    node = nodes.start("a", server={"workers": 2})
    assert readyz_answers(node.http_url, 200, 10)[1] == {0, 1}
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        lost_after, workers, body = readyz_answers(node.http_url, 503, 20)
        assert body["reason"] == "broker_unavailable", body
        assert workers == {0, 1}, workers
        assert lost_after < 8.0, lost_after
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    back_after, workers, _ = readyz_answers(node.http_url, 200, 20)
    assert workers == {0, 1}, workers
    assert back_after < 8.0, back_after
    assert httpx.get(f"{node.http_url}/healthz", timeout=5).status_code == 200  # liveness all along
    print(f"\n/readyz: 503 broker_unavailable {lost_after:.2f} s after SIGSTOP, 200 {back_after:.2f} s after SIGCONT")
