"""Rate limits: a token bucket, token buckets keyed by peer address, and the rate-limited log of bad client
input (a peer cannot flood the log, or the disk, by misbehaving).

One `BadInputLog` per process (on the hub). Each call counts the event by source; at most `per_second`
lines are written per second (a token bucket with a burst of the same size), the rest are only counted
and exported as `fanout_bad_input_total{source}`. No traceback is ever logged for a peer's mistake.

`RateLog` is the same bound for any other line that peers can cause by the thousand (the slow consumers cut,
gateway/clients.py): the events are counted where they happen (a metric), the lines are a sample.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator

from prometheus_client.core import Metric

from ..ops.metrics import counter_family

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

    def refill(self) -> float:
        """The tokens there are now."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def take(self) -> bool:
        if self.refill() < 1:
            return False
        self.tokens -= 1
        return True


class AddressRates:
    """A token bucket per key (a peer address) in this process, in a table of at most `max_keys` (the least
    recently used is forgotten: its next use starts with a full bucket, which costs an attacker an address
    per burst). The verbs of gateway/edge/addrcount.py's `SharedRate`, which replaces it with `server.workers` > 1
    so one address has one bucket whichever worker serves it. `rate` 0: no refill."""

    def __init__(self, rate: float, burst: float, max_keys: int = 65_536, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: dict[Hashable, TokenBucket] = {}

    def _bucket(self, key: Hashable) -> TokenBucket:
        buckets = self._buckets
        bucket = buckets.pop(key, None)
        if bucket is None:
            if len(buckets) >= self.max_keys:
                del buckets[next(iter(buckets))]
            bucket = TokenBucket(self.rate, self.burst, clock=self.clock)
        buckets[key] = bucket  # most recently used last
        return bucket

    def tokens(self, key: Hashable) -> float:
        """Tokens left for `key` now (nothing taken)."""
        return self._bucket(key).refill()

    def take(self, key: Hashable) -> bool:
        """Take one token for `key`; False (nothing taken) when less than one is left."""
        return self._bucket(key).take()

    def charge(self, key: Hashable) -> None:
        """Take one token for `key` whatever is left (an empty bucket stays empty, never below)."""
        bucket = self._bucket(key)
        bucket.tokens = max(0.0, bucket.refill() - 1)


class RateLog:
    """A logger's lines at `per_second` on average and `burst` at once at most; a line over the rate is not
    written, and the next line written says how many were not (the events are counted elsewhere)."""

    def __init__(
        self,
        logger: logging.Logger,
        per_second: float,
        burst: float,
        *,
        level: int = logging.INFO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.bucket = TokenBucket(per_second, burst, clock=clock)
        self.suppressed = 0

    def __call__(self, message: str, *args: object, **fields: object) -> bool:
        """Log `message % args` if the rate allows (`fields`: the json format's fields). True if logged."""
        if not self.bucket.take():
            self.suppressed += 1
            return False
        if self.suppressed:
            self.logger.log(
                self.level,
                message + " (%d more not logged)",
                *args,
                self.suppressed,
                extra={**fields, "suppressed": self.suppressed},
            )
            self.suppressed = 0
        else:
            self.logger.log(self.level, message, *args, extra=fields)
        return True


class BadInputLog:
    def __init__(self, per_second: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second = per_second
        self.bucket = TokenBucket(per_second, per_second, clock=clock)
        self.by_source: Counter[str] = Counter()
        self.suppressed = 0

    def __call__(self, source: str, message: str, *args: object, **fields: object) -> bool:
        """Count one bad input from `source` (e.g. "ws", "ingest"); log it if the rate allows. True if logged.
        `fields`: the line's fields in the json log format (gateway/ops/logformat.py), e.g. `peer`."""
        self.by_source[source] += 1
        if not self.bucket.take():  # per_second <= 0: never
            self.suppressed += 1
            return False
        if self.suppressed:
            log.warning(
                "bad input (%s): " + message + " (%d more not logged)",
                source,
                *args,
                self.suppressed,
                extra={**fields, "source": source, "suppressed": self.suppressed},
            )
            self.suppressed = 0
        else:
            log.warning("bad input (%s): " + message, source, *args, extra={**fields, "source": source})
        return True

    def collect(self) -> Iterator[Metric]:
        yield counter_family(
            "fanout_bad_input", "bad client input by source (logged at a bounded rate)", "source", self.by_source
        )
