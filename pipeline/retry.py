"""Bounded, configurable retry with exponential backoff, for reaching the gateway (ingest connections in the
Spark tasks, admin API calls on the driver) while it is down or restarting.

``RetryPolicy(attempts=8, initial=0.5, maximum=8.0)`` waits 0.5, 1, 2, 4, 8, 8, 8, 8 s between attempts:
about 40 s in all before giving up, which covers a gateway restart. ``attempts=0`` fails at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["DEFAULT_RETRY", "NO_RETRY", "RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    #: retries after the first failure of one operation (0: no retry)
    attempts: int = 8
    #: first wait in seconds, doubled after each failure...
    initial: float = 0.5
    #: ... up to this many seconds
    maximum: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.initial < 0 or self.maximum < self.initial:
            raise ValueError(f"bad retry policy {self!r}: attempts >= 0, 0 <= initial <= maximum")

    def delays(self) -> Iterator[float]:
        delay = self.initial
        for _ in range(self.attempts):
            yield delay
            delay = min(self.maximum, delay * 2)

    @property
    def budget(self) -> float:
        """Seconds spent waiting when every attempt fails."""
        return sum(self.delays())

    def call(
        self,
        fn: Callable[[], T],
        retryable: Callable[[BaseException], bool],
        on_retry: Callable[[BaseException, float], None] | None = None,
    ) -> T:
        """``fn()``, called again after each retryable failure until the attempts run out (then the last
        failure is raised)."""
        delays = self.delays()
        while True:
            try:
                return fn()
            except Exception as exc:
                if not retryable(exc):
                    raise
                delay = next(delays, None)
                if delay is None:
                    raise
                if on_retry is not None:
                    on_retry(exc, delay)
                time.sleep(delay)


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=0, initial=0.0, maximum=0.0)
