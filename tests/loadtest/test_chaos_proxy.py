"""The chaos run's faulty TCP proxy (loadtest/chaos_clients.py): path-lossy resets a share of the connections."""

from __future__ import annotations

import asyncio
import random

import pytest

from loadtest.chaos_clients import FaultyProxy

pytestmark = pytest.mark.unit


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_reset_share_resets_that_share_of_the_connections_with_an_rst_and_spares_the_others() -> None:
    async def go() -> None:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        proxy = FaultyProxy(int(server.sockets[0].getsockname()[1]))
        await proxy.start()
        conns = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(20)]
        for r, w in conns:
            w.write(b"x")
            await w.drain()
            assert await r.readexactly(1) == b"x"
        assert len(proxy.pairs) == 20
        assert proxy.reset_share(0.0, random.Random(1)) == 0
        reset = proxy.reset_share(0.5, random.Random(1))
        assert 0 < reset < 20
        ended = 0
        for r, w in conns:
            try:
                w.write(b"y")
                await w.drain()
                got = await asyncio.wait_for(r.read(1), 2)
            except (ConnectionResetError, BrokenPipeError):
                got = b""
            ended += got == b""
            w.close()
        assert ended == reset
        await proxy.close()
        server.close()

    asyncio.run(go())
