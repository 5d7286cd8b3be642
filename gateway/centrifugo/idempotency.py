"""Publishes with an `idempotency_key` (Centrifugo's, per channel): a retry within IDEMPOTENCY_TTL_S gets the
first publish's result and publishes nothing. The first one's answer is shared while it is still on its way,
so two concurrent tries publish once; a publish that failed is forgotten, so its retry publishes.

Kept in this process: with a broker or several workers, a retry that reaches another node or worker publishes
again (docs/centrifugo.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from .api_errors import bad_request

#: how long a key is remembered, as Centrifugo's cache
IDEMPOTENCY_TTL_S = 300.0
#: keys remembered at most (the oldest is forgotten first): a publisher cannot grow the table without bound
MAX_KEYS = 10_000
MAX_KEY_CHARS = 256

Result = dict[str, Any]


class IdempotentPublishes:
    def __init__(self, ttl: float = IDEMPOTENCY_TTL_S, max_keys: int = MAX_KEYS) -> None:
        self.ttl = ttl
        self.max_keys = max_keys
        #: (channel, key) -> (expiry on the monotonic clock, the first publish's result), oldest first
        self._results: OrderedDict[tuple[str, str], tuple[float, asyncio.Future[Result]]] = OrderedDict()

    async def publish(self, channel: str, key: str, publish: Callable[[], Awaitable[Result]]) -> Result:
        if not key or len(key) > MAX_KEY_CHARS:
            raise bad_request(f"idempotency_key must be 1..{MAX_KEY_CHARS} characters")
        now = time.monotonic()
        self._expire(now)
        known = self._results.get((channel, key))
        if known is not None:
            return await asyncio.shield(known[1])
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._results[(channel, key)] = (now + self.ttl, future)
        while len(self._results) > self.max_keys:
            self._results.popitem(last=False)
        try:
            result = await publish()
        except BaseException as exc:
            if self._results.get((channel, key), (0.0, None))[1] is future:
                del self._results[(channel, key)]
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: a failure nobody else awaited is not logged as lost
            else:
                future.cancel()
            raise
        future.set_result(result)
        return result

    def _expire(self, now: float) -> None:
        while self._results:
            expires_at, _ = next(iter(self._results.values()))
            if expires_at > now:
                return
            self._results.popitem(last=False)
