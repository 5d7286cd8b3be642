"""Successive messages of a topic for the Fossil delta tests: JSON order books and their updates."""

from __future__ import annotations

import random
from typing import Any

import orjson


def order_book(rng: random.Random, levels: int) -> dict[str, Any]:
    """An exchange's depth snapshot: ``levels`` [price, quantity] pairs a side, as decimal strings."""
    mid = rng.uniform(1, 50_000)
    tick = mid / 10_000
    return {
        "lastUpdateId": rng.randrange(1 << 40),
        "bids": [[f"{mid - (i + 1) * tick:.8f}", f"{rng.uniform(0.01, 500):.8f}"] for i in range(levels)],
        "asks": [[f"{mid + (i + 1) * tick:.8f}", f"{rng.uniform(0.01, 500):.8f}"] for i in range(levels)],
    }


def next_book(rng: random.Random, book: dict[str, Any], changes: int) -> dict[str, Any]:
    """The next update: ``changes`` quantities changed, sometimes a level gone and a new one at the end."""
    book = orjson.loads(orjson.dumps(book))
    book["lastUpdateId"] += rng.randint(1, 50)
    for _ in range(changes):
        side = book[rng.choice(("bids", "asks"))]
        side[rng.randrange(len(side))][1] = f"{rng.uniform(0.01, 500):.8f}"
    if rng.random() < 0.3:
        side = book[rng.choice(("bids", "asks"))]
        gone = side.pop(rng.randrange(len(side)))
        side.append([gone[0][::-1], "1.00000000"])
    return book


def book_pairs(seed: int, count: int, levels: int = 20, changes: int = 3) -> list[tuple[bytes, bytes]]:
    """``count`` (previous, next) JSON texts, as the gateway encodes them."""
    rng = random.Random(seed)
    pairs = []
    book = order_book(rng, levels)
    for i in range(count):
        if i % 10 == 0:
            book = order_book(rng, rng.randint(1, levels))
        update = next_book(rng, book, changes)
        pairs.append((orjson.dumps(book), orjson.dumps(update)))
        book = update
    return pairs
