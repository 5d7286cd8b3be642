"""fanout_client and a draining gateway: close 1012 "restarting: reconnect in N ms" makes the client wait N ms
(at most `backoff_max`) before reconnecting, instead of its quick backoff (docs/client.md)."""

from __future__ import annotations

import asyncio
import time

import pytest
from websockets.asyncio.server import ServerConnection, serve

import fanout_client
from fanout_client.client import restart_hint_s

pytestmark = pytest.mark.timeout(30)


def test_restart_hint_is_read_from_a_1012_reason_only() -> None:
    assert restart_hint_s(1012, "restarting: reconnect in 1234 ms") == 1.234
    assert restart_hint_s(1012, "restarting: reconnect in 0 ms") == 0.0
    assert restart_hint_s(1012, "Service Restart") is None
    assert restart_hint_s(1001, "restarting: reconnect in 1234 ms") is None


async def _reconnect_gap(hint_ms: int, backoff_max: float) -> float:
    """A server that closes the first connection with 1012 and the hint; seconds until the second came."""
    opened: list[float] = []
    second = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        opened.append(time.monotonic())
        if len(opened) == 1:
            await ws.close(1012, f"restarting: reconnect in {hint_ms} ms")
            return
        second.set()
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = fanout_client.connect(f"ws://127.0.0.1:{port}/ws", backoff_base=0.01, backoff_max=backoff_max, start_timeout=0)
        client.start()
        try:
            await asyncio.wait_for(second.wait(), 10)
            assert client.last_close is not None and client.last_close.code == 1012
        finally:
            await client.close()
    return opened[1] - opened[0]


def test_a_1012_hint_delays_the_reconnect() -> None:
    gap = asyncio.run(_reconnect_gap(800, backoff_max=15.0))
    assert 0.75 <= gap < 2.0, gap  # without the hint: at most backoff_base (10 ms)


def test_the_hint_is_capped_by_backoff_max() -> None:
    gap = asyncio.run(_reconnect_gap(60_000, backoff_max=0.4))
    assert 0.35 <= gap < 1.5, gap
