"""Micro-benchmark of the Fossil delta codec (core.fossil): `python -m loadtest.fossil_bench [--rounds N]`.

For two message shapes, each followed by the next message of its topic, prints (figures only, no verdict):
* the sizes: whole, delta, and both deflated as permessage-deflate would (raw deflate, no context takeover);
* the delta's size as a share of the whole message;
* the cost of `delta` (once per publication at the gateway) and of `apply` (once per message at a client),
  in microseconds, the best of a few runs of ``--rounds`` calls.

The shapes: a 1.3 KB JSON order book (20 levels a side, decimal strings) with 3 levels and its update id
changed, and a 130-byte price tick with its prices, time and sequence changed.
"""

from __future__ import annotations

import argparse
import random
import timeit
import zlib
from collections.abc import Callable
from typing import Any

import orjson

from core.fossil import apply, delta

LEVELS = 20
CHANGED_LEVELS = 3


def order_book(rng: random.Random) -> dict[str, Any]:
    mid = 27_431.5
    return {
        "lastUpdateId": 160_448_213_371,
        "bids": [[f"{mid - (i + 1) * 0.5:.8f}", f"{rng.uniform(0.01, 20):.8f}"] for i in range(LEVELS)],
        "asks": [[f"{mid + (i + 1) * 0.5:.8f}", f"{rng.uniform(0.01, 20):.8f}"] for i in range(LEVELS)],
    }


def book_update(rng: random.Random, book: dict[str, Any]) -> dict[str, Any]:
    update: dict[str, Any] = orjson.loads(orjson.dumps(book))
    update["lastUpdateId"] += 7
    for _ in range(CHANGED_LEVELS):
        side = update[rng.choice(("bids", "asks"))]
        side[rng.randrange(LEVELS)][1] = f"{rng.uniform(0.01, 20):.8f}"
    return update


def tick(seq: int, bid: float) -> dict[str, Any]:
    return {
        "symbol": "EURUSD",
        "venue": "LMAX",
        "bid": f"{bid:.5f}",
        "ask": f"{bid + 0.00003:.5f}",
        "bid_size": "1000000",
        "ask_size": "2500000",
        "ts": 1_764_201_600_123 + seq * 37,
        "seq": seq,
    }


def deflated(data: bytes) -> int:
    """Bytes after a raw deflate on its own, as permessage-deflate with no context takeover sends them."""
    compressor = zlib.compressobj(wbits=-15)
    return len(compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)) - 4  # RFC 7692 drops 00 00 ff ff


def microseconds(call: Callable[[], object], rounds: int) -> float:
    return min(timeit.repeat(call, number=rounds, repeat=5)) / rounds * 1e6


def report(name: str, previous: bytes, current: bytes, rounds: int) -> None:
    encoded = delta(previous, current)
    assert apply(previous, encoded) == current
    print(f"{name}:")
    print(
        f"  whole {len(current)} B (deflated {deflated(current)} B), delta {len(encoded)} B "
        f"(deflated {deflated(encoded)} B): delta/whole {len(encoded) / len(current):.3f}, "
        f"deflated delta/whole {deflated(encoded) / len(current):.3f}"
    )
    print(
        f"  delta {microseconds(lambda: delta(previous, current), rounds):.1f} us, "
        f"apply {microseconds(lambda: apply(previous, encoded), rounds):.1f} us"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.fossil_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2000, help="calls per timed run (default 2000)")
    args = parser.parse_args(argv)
    rng = random.Random(1)
    book = order_book(rng)
    report(
        f"order book ({LEVELS} levels a side, {CHANGED_LEVELS} changed)",
        orjson.dumps(book),
        orjson.dumps(book_update(rng, book)),
        args.rounds,
    )
    report("price tick", orjson.dumps(tick(1041, 1.08412)), orjson.dumps(tick(1042, 1.08415)), args.rounds)


if __name__ == "__main__":
    main()
