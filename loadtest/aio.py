"""Event loop choice for the load generator's processes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # plain asyncio still works, only slower
        return asyncio.run(coro)
    return uvloop.run(coro)


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`'s result, or TimeoutError after `seconds`. Not `asyncio.wait_for`: on Python 3.11 it
    swallows a cancel that comes as the awaited thing finishes, and a loop around it then never stops."""
    async with asyncio.timeout(seconds):
        return await awaitable
