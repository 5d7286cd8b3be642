"""fanout_client and a hostile gateway's deltas (hardening round 4, finding 5): a websockets server written here
answers every subscribe with `subscribed` and a fossil delta that cannot apply. Unbounded, the client
resubscribed at once after each failure: 159,000 failed deltas in 4 s, 318,002 requests waiting for an
answer, +57 MiB. Now the resubscribe waits out a backoff (full jitter, doubling from ``backoff_base``, at most
``backoff_max``; reset by a message that applies), what comes for the topic meanwhile is ignored, and the
table of commands waiting for an answer keeps one subscribe and one unsubscribe per topic."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import ServerConnection, serve

import fanout_client
from fanout_client import Message
from tests.client.hostile_deltas import BAD_DELTA, SUBSCRIBED, TOPIC, commands, reset_answer

pytestmark = pytest.mark.timeout(60)


async def _answer_pings(ws: ServerConnection, command: dict[str, Any]) -> bool:
    if command.get("op") == "ping":
        await ws.send(orjson.dumps([{"type": "reply", "id": command["id"], "result": "pong"}]), text=True)
        return True
    return False


def test_failing_deltas_resubscribe_with_backoff_and_a_bounded_table() -> None:
    async def main() -> None:
        subscribes = 0

        async def hostile(ws: ServerConnection) -> None:
            nonlocal subscribes
            async for frame in ws:
                for command in commands(frame):
                    if await _answer_pings(ws, command) or command.get("op") != "subscribe":
                        continue  # unsubscribes are never answered
                    subscribes += 1
                    # answered without its id, then once more unasked: each pair a failed delta
                    await ws.send(orjson.dumps([SUBSCRIBED, BAD_DELTA, SUBSCRIBED, BAD_DELTA]), text=True)

        async with serve(hostile, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            async with fanout_client.connect(f"ws://127.0.0.1:{port}/ws") as client:  # default backoff
                sub = await client.subscribe(TOPIC, delta="fossil")
                peak_pending = 0
                for _ in range(300):  # 3 s
                    peak_pending = max(peak_pending, len(client._table.pending))
                    await asyncio.sleep(0.01)
                assert sub.closed_reason is None and client.reconnects == 0
                # 0.5 s doubling, full jitter: ~4 expected in 3 s (without the backoff: tens of thousands)
                assert 1 <= subscribes <= 12, subscribes
                # one failure per subscribe answered: the second pair came while the resubscribe waited
                assert sub.delta_failures <= subscribes, (sub.delta_failures, subscribes)
                # the topic's one subscribe and one unsubscribe (this gateway answers neither with its id)
                assert peak_pending <= 2, peak_pending

    asyncio.run(main())


def test_the_backoff_resets_on_a_message_that_applies_and_resumes_from_its_seq() -> None:
    async def main() -> None:
        asked: list[dict[str, Any]] = []
        done = asyncio.Event()

        async def gateway(ws: ServerConnection) -> None:
            async for frame in ws:
                for command in commands(frame):
                    if await _answer_pings(ws, command) or command.get("op") != "subscribe":
                        continue
                    asked.append(command)
                    entries = reset_answer(len(asked), command)
                    if len(asked) >= 5:
                        done.set()
                    await ws.send(orjson.dumps(entries), text=True)

        async with serve(gateway, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            async with fanout_client.connect(f"ws://127.0.0.1:{port}/ws", backoff_base=0.02) as client:
                sub = await client.subscribe(TOPIC, delta="fossil")
                first, second = await sub.get(5), await sub.get(5)
                assert isinstance(first, Message) and isinstance(second, Message), (first, second)
                assert [(first.seq, first.data), (second.seq, second.data)] == [(0, {"bid": 1}), (1, {"bid": 2})]
                await asyncio.wait_for(done.wait(), 10)
                assert sub._delta_retries == 1  # the messages that applied reset it; the failure after: 1
                assert sub.delta_failures == 4 and sub.deltas_applied == 1
        start = {"epoch": "e1", "seq": 0}
        assert [c.get("since") for c in asked] == [None, start, start, start, {"epoch": "e1", "seq": 2}]

    asyncio.run(main())
