"""fanout_client against a hostile gateway (issue 34, items 8 and 12): WebSocket servers written here with
websockets' asyncio server on 127.0.0.1, each breaking one rule a real gateway keeps, and one real gateway
sending the largest frame it can build.

* pings in a loop and never reads: the pongs the client owes pile up unwritten; it must drop the connection
  with a bounded write buffer (without the bound: +105 MiB in 10 s);
* one frame larger than any the gateway builds: refused (1009) from its header, never read nor decoded;
* 1012 "reconnect in 0 ms" on every connection: the hint is a lower bound, the backoff still grows;
* a flood of `error` entries without an id: a handful of log lines, and the count of the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import ServerConnection, serve

import fanout_client
from fanout_client.client import REPLY_BYTES_WHILE_BLOCKED
from gateway.testing import run_gateway
from tests import web

pytestmark = pytest.mark.timeout(60)

#: a server's ping frame (FIN, opcode 9) with the largest payload a control frame may carry
PING_FRAME = b"\x89\x7d" + b"p" * 125


async def _wait_for(predicate: Any, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


async def _ping_flood(ws: ServerConnection) -> None:
    """Never read what the client writes; write pings as fast as the client takes them."""
    transport = ws.transport
    transport.pause_reading()
    burst = PING_FRAME * 512
    while not transport.is_closing():
        if transport.get_write_buffer_size() > 1 << 20:
            await asyncio.sleep(0.001)  # our own writes wait for the client to read: only its buffer may grow
            continue
        transport.write(burst)
        await asyncio.sleep(0)


def test_a_gateway_that_pings_and_never_reads_is_dropped_with_a_bounded_write_buffer() -> None:
    async def main() -> None:
        async with serve(_ping_flood, "127.0.0.1", 0, ping_interval=None) as server:
            port = server.sockets[0].getsockname()[1]
            client = fanout_client.connect(f"ws://127.0.0.1:{port}/ws", start_timeout=None, backoff_base=5.0)
            client.start()
            peak = 0

            def dropped() -> bool:
                nonlocal peak
                ws = client._ws
                if ws is not None:
                    peak = max(peak, ws.transport.get_write_buffer_size())
                return client.last_close is not None

            try:
                assert await _wait_for(dropped, 20, step=0.002), f"still connected, {peak} bytes buffered"
                assert client.last_close is not None
                assert client.last_close.code == 1006
                assert "does not read" in client.last_close.reason, client.last_close
                # the replies counted when it dropped: the bound, and at most one read's pongs past it
                owed = int(client.last_close.reason.split(": ")[1].split()[0])
                assert REPLY_BYTES_WHILE_BLOCKED < owed <= REPLY_BYTES_WHILE_BLOCKED + 300 * 1024, owed
            finally:
                await client.close()
            # the asyncio write buffer's high-water mark (32 KiB), the replies allowed past it, and the pongs
            # of one read (asyncio reads 256 KiB at most: ~2,000 pings)
            assert peak <= 32 * 1024 + REPLY_BYTES_WHILE_BLOCKED + 300 * 1024, peak

    asyncio.run(main())


def test_a_frame_larger_than_the_gateway_sends_is_refused_1009_unread() -> None:
    async def main() -> None:
        sent = asyncio.Event()

        async def huge(ws: ServerConnection) -> None:
            # 3 MiB of tiny JSON values: decoded, ~80 MB of Python objects (a 64 MiB one: 1.7 GB)
            await ws.send(b"[" + b"[]," * (1 << 20) + b"[]]", text=True)
            sent.set()
            await ws.wait_closed()

        async with serve(huge, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = fanout_client.connect(f"ws://127.0.0.1:{port}/ws", start_timeout=None, backoff_base=5.0)
            client.start()
            try:
                assert await _wait_for(lambda: client.last_close is not None, 10)
                assert client.last_close is not None and client.last_close.code == 1009, client.last_close
            finally:
                await client.close()

    asyncio.run(main())


def test_the_largest_frame_a_gateway_builds_is_taken_with_the_defaults() -> None:
    """A cycle's budget of small messages, then one message entry of scheduler.max_message_bytes: the largest
    frame of a gateway with the default config (~1.06 MiB), under the client's default max_frame_bytes."""

    async def main(http_url: str, admin_token: str) -> None:

        # feed.* takes 16 entries per cycle: 15 of ~4 KB (under a cycle's budget of 64 KiB), then the large
        # one goes too (an entry goes while the budget is not reached)
        small = [{"n": i, "pad": "s" * 4000} for i in range(15)]
        big = {"pad": "b" * ((1 << 20) - 300)}  # the entry (topic, seq, data) just under 1 MiB
        async with fanout_client.connect(http_url, start_timeout=10) as client:
            sub = await client.subscribe("feed.big")
            async with web.AsyncClient(timeout=10) as http:
                r = await http.post(
                    f"{http_url}/api/topics/feed.big/publish",
                    json={"messages": [*small, big]},
                    headers={"Authorization": f"Bearer {admin_token}"},
                )
                assert r.status_code == 200, r.text
            events = [await sub.get(10) for _ in range(len(small) + 1)]
            assert [getattr(e, "data", None) for e in events] == [*small, big]
            assert client.reconnects == 0 and client.last_close is None

    with run_gateway() as gw:
        asyncio.run(main(gw.http_url, gw.admin_token))


def test_1012_reconnect_in_0_ms_does_not_replace_the_backoff() -> None:
    async def main() -> int:
        connections = 0

        async def restart_at_once(ws: ServerConnection) -> None:
            nonlocal connections
            connections += 1
            await ws.close(1012, "restarting: reconnect in 0 ms")

        async with serve(restart_at_once, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = fanout_client.connect(f"ws://127.0.0.1:{port}/ws", start_timeout=None)  # default backoff
            client.start()
            await asyncio.sleep(1.5)
            await client.close()
        return connections

    connections = asyncio.run(main())
    # 0.5 s doubling, full jitter: ~3 expected in 1.5 s, more than 10 about never (without the bound: thousands)
    assert 1 <= connections <= 10, connections


def test_a_flood_of_error_entries_logs_a_handful_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    entries = [{"type": "error", "code": "bad_request", "message": f"flood {i}"} for i in range(100)]
    frame = orjson.dumps(entries)
    frames = 2000  # 200,000 error entries without an id (no request owns them: logged, without on_error)

    async def main() -> None:
        connections = 0

        async def flood(ws: ServerConnection) -> None:
            nonlocal connections
            connections += 1
            if connections == 1:
                for _ in range(frames):
                    await ws.send(frame, text=True)
                await ws.close(1000, "flood over")  # read by the client after every frame before it
            await ws.wait_closed()

        async with serve(flood, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = fanout_client.connect(f"ws://127.0.0.1:{port}/ws", start_timeout=None)
            client.start()
            try:
                assert await _wait_for(lambda: client.last_close is not None, 30)
            finally:
                await client.close()  # tells the count of the lines not logged

    with caplog.at_level(logging.WARNING, logger="fanout_client"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "fanout_client"]
    assert 1 <= len(lines) <= 12, (len(lines), lines[:20])
    logged = [line for line in lines if "bad_request: flood" in line]
    counts = [line for line in lines if "not logged" in line]
    assert logged and counts, lines
    not_logged = sum(int(line.split("fanout_client: ")[1].split()[0]) for line in counts)
    assert len(logged) + not_logged == frames * len(entries), lines
