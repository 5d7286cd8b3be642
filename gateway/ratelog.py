"""Rate limits: a token bucket, and the rate-limited log of bad client input (a peer cannot flood the log,
or the disk, by misbehaving).

One `BadInputLog` per process (on the hub). Each call counts the event by source; at most `per_second`
lines are written per second (a token bucket with a burst of the same size), the rest are only counted
and exported as `fanout_bad_input_total{source}`. No traceback is ever logged for a peer's mistake.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("gateway.input")


class TokenBucket:
    """`rate` events per second on average, `burst` at once: refilled on use, no timer."""

    __slots__ = ("rate", "burst", "tokens", "stamp", "clock")

    def __init__(self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.clock = clock
        self.stamp = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class BadInputLog:
    def __init__(self, per_second: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second = per_second
        self.bucket = TokenBucket(per_second, per_second, clock=clock)
        self.by_source: Counter[str] = Counter()
        self.suppressed = 0

    def __call__(self, source: str, message: str, *args: object) -> bool:
        """Count one bad input from `source` (e.g. "ws", "ingest"); log it if the rate allows. True if logged."""
        self.by_source[source] += 1
        if not self.bucket.take():  # per_second <= 0: never
            self.suppressed += 1
            return False
        if self.suppressed:
            log.warning("bad input (%s): " + message + " (%d more not logged)", source, *args, self.suppressed)
            self.suppressed = 0
        else:
            log.warning("bad input (%s): " + message, source, *args)
        return True
