"""Per-address limits that hold across `server.workers` processes (docs/security.md, Limits).

Each worker counts its own connections and sessions per peer address; with N workers a client spread over
them by the kernel would get N times every per-address limit. So the supervisor maps one shared anonymous
memory region before it forks (`SharedCounts`): one column of 32-bit counters per worker, `SLOTS` counters
a column, a key's slot chosen by a keyed hash (BLAKE2b with a random key made at start, so a client cannot
aim its addresses at another's slot). A worker writes only its own column (one writer: no lock, no atomic
instruction needed) and reads the others' (aligned 32-bit reads are whole), so a key's count in the cluster
is its exact count here plus the other workers' counters of its slot.

Costs and limits of the design, stated: a check and an update are a hash and N-1 reads (about a
microsecond); two workers admitting the same address at the same instant may both pass at limit - 1, so a
limit can be exceeded by at most N-1; keys that share a slot in another worker's column count together there
(with 2^18 slots, a given address shares one with probability about addresses / 262,144), which can only
refuse early, never admit beyond a limit. Memory: 1 MiB of address space per worker, of which only touched
pages are resident. A worker that dies has its column zeroed by the supervisor before it is forked again
(gateway/workers/supervisor.py), so no stale count outlives it.

The token buckets keyed by address (`limits.topic_create_rate` / `topic_create_burst`, `auth.rate_per_ip` /
`burst_per_ip`) are shared the same way (`SharedRate`): one table of 64-bit floats per bucket kind, a
column per worker, each worker writing only its own. A bucket is kept as GCRA keeps it (the generic cell
rate algorithm): one number X, in tokens, such that the tokens left at time t are burst - (X - rate * t),
X never below rate * t; a take is X + 1. The cluster's X for a key is the largest of the workers' values
in its slot, and a worker writes only a larger value into its own column, so every take any worker made
counts, with no lock. What this does not promise: two workers taking from the same bucket at the same
instant (between one's read and its write, about a microsecond) may both see the same X and count one take
between them, so a burst can be exceeded by at most N-1 per such coincidence; addresses that share a slot
(probability about addresses / 262,144) share a bucket, which can refuse early but never admits beyond a
limit.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar, cast

#: counters per worker column (a power of two)
SLOTS = 1 << 18
_WIDTH = 4  # bytes of a counter
#: the shared token bucket tables (`SharedRate`): topic creations per address, token checks per address
RATE_TABLES = ("topic_create", "token_check")
_RATE_WIDTH = 8  # bytes of a bucket (a float)


class SharedCounts:
    """The shared counters of every worker (module docstring). Made before the fork; `bind(index)` in the
    worker names its own column."""

    def __init__(self, workers: int, slots: int = SLOTS) -> None:
        self.workers = workers
        self.slots = slots
        self._map = mmap.mmap(-1, workers * slots * _WIDTH)  # MAP_SHARED | MAP_ANONYMOUS: children share it
        self._key = os.urandom(16)
        view = memoryview(self._map)
        self.columns = [view[i * slots * _WIDTH : (i + 1) * slots * _WIDTH].cast("i") for i in range(workers)]
        self.index = 0
        # the token buckets: a table per kind, a column of floats per worker (2 MiB of address space each)
        column = slots * _RATE_WIDTH
        self._rates = mmap.mmap(-1, len(RATE_TABLES) * workers * column)
        rates = memoryview(self._rates)
        self.rate_columns = {
            name: [rates[(t * workers + i) * column : (t * workers + i + 1) * column].cast("d") for i in range(workers)]
            for t, name in enumerate(RATE_TABLES)
        }

    def bind(self, index: int) -> None:
        self.index = index

    def slot(self, namespace: str, key: Hashable) -> int:
        digest = hashlib.blake2b(f"{namespace}\0{key!r}".encode(), key=self._key, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (self.slots - 1)

    def others(self, slot: int) -> int:
        """What the other workers count in `slot`."""
        return sum(column[slot] for i, column in enumerate(self.columns) if i != self.index)

    def add(self, slot: int, delta: int) -> None:
        self.columns[self.index][slot] += delta

    def counter(self, namespace: str) -> "SharedCounter[Any]":
        return SharedCounter(self, namespace)

    def rate(self, table: str, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> "SharedRate":
        """The token buckets of `table` (one of RATE_TABLES), shared by every worker."""
        return SharedRate(self, table, rate, burst, clock)


class SharedRate:
    """Token buckets keyed by address whose tokens every worker takes from (module docstring: GCRA, each
    worker's column holding the largest X it wrote). `clock` is CLOCK_MONOTONIC, the same in every process.
    `rate` 0: no refill (a burst per address)."""

    def __init__(
        self, shared: SharedCounts, table: str, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.shared = shared
        self.table = table
        self.rate = rate
        self.burst = float(burst)
        self.clock = clock
        self.columns = shared.rate_columns[table]

    def _read(self, key: Hashable) -> tuple[int, float, float]:
        """(slot, X in the cluster, rate * now)."""
        slot = self.shared.slot(self.table, key)
        base = self.clock() * self.rate
        return slot, max(base, max(column[slot] for column in self.columns)), base

    def _write(self, slot: int, value: float) -> None:
        own = self.columns[self.shared.index]
        if value > own[slot]:
            own[slot] = value

    def tokens(self, key: Hashable) -> float:
        """Tokens left for `key` now (nothing taken)."""
        _, x, base = self._read(key)
        return self.burst - (x - base)

    def take(self, key: Hashable) -> bool:
        """Take one token for `key`; False (nothing taken) when less than one is left."""
        slot, x, base = self._read(key)
        if self.burst - (x - base) < 1:
            return False
        self._write(slot, x + 1)
        return True

    def charge(self, key: Hashable) -> None:
        """Take one token for `key` whatever is left (an empty bucket stays empty, never below)."""
        slot, x, base = self._read(key)
        self._write(slot, min(x + 1, base + self.burst))


_K = TypeVar("_K", bound=Hashable)


class SharedCounter(Counter[_K], Generic[_K]):
    """A drop-in `Counter` for per-address counts whose reads answer the cluster's count.

    It stores this worker's own counts (and mirrors them into its shared column); `c[key]` is the own count
    plus the other workers'. So the usual `c[key] += 1`, `c[key] -= 1`, `if not c[key]: del c[key]` and
    `c[key] >= limit` work unchanged: an assignment applies the difference to the value last read for that
    key (read and write happen in one step of the event loop; another worker's change in between is not
    mistaken for ours). Keys whose own count drops to 0 are not kept.
    """

    def __init__(self, shared: SharedCounts, namespace: str) -> None:
        super().__init__()
        self.shared = shared
        self.namespace = namespace
        self._last: tuple[_K, int] | None = None  # (key, cluster count read)

    def __getitem__(self, key: _K) -> int:
        total = dict.get(self, key, 0) + self.shared.others(self.shared.slot(self.namespace, key))
        self._last = (key, total)
        return total

    def __setitem__(self, key: _K, value: int) -> None:
        last = self._last
        base = last[1] if last is not None and last[0] == key else self[key]
        self._last = None
        own = dict.get(self, key, 0)
        new_own = own + value - base
        if new_own < 0:
            new_own = 0
        self.shared.add(self.shared.slot(self.namespace, key), new_own - own)
        if new_own:
            dict.__setitem__(self, key, new_own)
        else:
            dict.pop(self, key, None)

    def __delitem__(self, key: Hashable) -> None:  # Counter accepts any key here (an absent one is a no-op)
        own = dict.pop(self, cast(_K, key), 0)
        if own:
            self.shared.add(self.shared.slot(self.namespace, key), -own)
        self._last = None

    def own(self, key: _K) -> int:
        """This worker's own count."""
        return dict.get(self, key, 0)
