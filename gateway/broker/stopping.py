"""Stopping the broker's tasks, even those a dependency's cancel handling lets run on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

#: how often a cancel is sent again to a task that did not end
RESEND_S = 0.05


async def stop_tasks(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until every one has ended, whatever they raise. A cancel is sent again every
    RESEND_S to a task still running: redis-py's commands now and then swallow a cancel that lands as they
    finish (redis 8.1 on Python 3.11: the readiness probe's loop went on, and the broker's stop waited for it
    for ever), and the next cancel finds the loop at its next await."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RESEND_S)
        for task in pending:
            task.cancel()
    for task in tasks:  # retrieved, so a task's own failure is not reported again when it is collected
        if not task.cancelled():
            task.exception()
