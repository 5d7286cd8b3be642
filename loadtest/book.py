"""The ``--payload book`` message: an order book of 20 levels a side (~1.3 KB of JSON), 3 levels changed per
update, the shape where compression and deltas pay (docs/benchmarks.md, "Bytes").

Each message carries ``sum``, the CRC-32 of its levels as orjson writes them, so a client that rebuilt the
message (inflated, or applied a delta) can tell it is intact (`intact`) without knowing what was published.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import orjson

#: levels a side, and levels changed per update
DEPTH = 20
CHANGED = 3
#: ``--payload`` names this shape instead of a padding size
BOOK = "book"


class Books:
    """One book per topic, each update changing `CHANGED` levels of it (deterministic for a seed)."""

    def __init__(self, topics: int, seed: int = 1) -> None:
        self.random = random.Random(seed)
        self.books = [self._fresh(t) for t in range(topics)]

    def _fresh(self, topic: int) -> dict[str, list[dict[str, str]]]:
        """Levels as exchanges send them: decimal strings, price and size named."""
        mid = 100 * (topic + 1)
        return {
            side: [{"price": f"{mid + sign * 0.05 * (i + 1):.2f}", "size": self._size()} for i in range(DEPTH)]
            for side, sign in (("bids", -1), ("asks", 1))
        }

    def _size(self) -> str:
        return f"{self.random.randint(1, 500000) / 100:.2f}"

    def data(self, topic: int, name: bytes, n: int, ts: int) -> bytes:
        """The next message of `topic`: ts, t, n, the levels, and their checksum."""
        book = self.books[topic]
        if n > 0:
            for _ in range(CHANGED):
                side = book["bids" if self.random.random() < 0.5 else "asks"]
                side[self.random.randrange(DEPTH)]["size"] = self._size()
        levels = orjson.dumps(book)
        return b'{"ts":%d,"t":"%s","n":%d,"levels":%s,"sum":%d}' % (ts, name, n, levels, zlib.crc32(levels))


def intact(data: Any) -> bool:
    """Whether a book message's levels are what its publisher wrote (its checksum)."""
    if type(data) is not dict or "levels" not in data:
        return True  # not a book (a priming message): nothing to check
    return zlib.crc32(orjson.dumps(data["levels"])) == data.get("sum")
