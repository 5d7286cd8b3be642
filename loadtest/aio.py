"""Event loop choice for the load generator's processes."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # plain asyncio still works, only slower
        return asyncio.run(coro)
    return uvloop.run(coro)
