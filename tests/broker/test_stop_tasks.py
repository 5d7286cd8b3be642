"""The broker's stop ends its loops even when a cancel is swallowed on the way, as redis-py's commands do now
and then when a cancel lands as they finish (redis 8.1, Python 3.11): the readiness probe's loop then went on at
its next sleep, and a stop that awaited it once hung for ever (CI: tests/cluster/test_long_outage.py, 120 s)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker.stopping import stop_tasks

pytestmark = pytest.mark.unit


def test_a_loop_that_swallows_two_cancels_is_stopped_and_failures_are_retrieved():
    async def main() -> tuple[int, list[bool]]:
        swallowed = 0

        async def probe_loop() -> None:  # what the probe did: a command swallows the cancel, the loop goes on
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(0.001)
                except asyncio.CancelledError:
                    if swallowed == 2:
                        raise
                    swallowed += 1

        async def failed() -> None:
            raise RuntimeError("a task's own failure")

        tasks = [asyncio.create_task(probe_loop()), asyncio.create_task(failed())]
        await asyncio.sleep(0.01)
        async with asyncio.timeout(2.0):
            await stop_tasks(tasks)
        return swallowed, [task.done() for task in tasks]

    swallowed, done = asyncio.run(main())
    assert swallowed == 2 and done == [True, True]


def test_tasks_already_done_and_no_tasks_return_at_once():
    async def main() -> None:
        finished = asyncio.create_task(asyncio.sleep(0))
        await finished
        async with asyncio.timeout(0.5):
            await stop_tasks([finished])
            await stop_tasks([])

    asyncio.run(main())
