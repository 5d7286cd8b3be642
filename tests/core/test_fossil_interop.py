"""Our Fossil deltas are read by another implementation: centrifuge-python's decoder (`centrifuge.fossil`,
the Python client of Centrifugo), installed as a test dependency only."""

from __future__ import annotations

import random

import centrifuge.fossil as centrifuge  # type: ignore[import-untyped]  # it ships no type information
import orjson
import pytest

from core.fossil import apply, checksum, delta
from tests.core.fossil_corpus import book_pairs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed, levels, changes", [(1, 20, 3), (2, 40, 3), (3, 5, 1), (4, 20, 12)])
def test_centrifuge_applies_our_order_book_deltas(seed, levels, changes):
    for previous, current in book_pairs(seed, count=60, levels=levels, changes=changes):
        ours = delta(previous, current)
        assert centrifuge.apply_delta(previous, ours) == current == apply(previous, ours)


def test_centrifuge_applies_our_deltas_of_text_as_sent_in_a_json_string():
    """The gateway sends a delta as a JSON string: the client gets it back with .encode()."""
    rng = random.Random(5)
    for _ in range(50):
        words = [rng.choice(["prix", "€", "价格", "🙂", "bid", "ask", "ø", " "]) for _ in range(rng.randint(0, 300))]
        previous = orjson.dumps({"note": "".join(words), "n": rng.random()})
        rng.shuffle(words)
        current = orjson.dumps({"note": "".join(words[: len(words) // 2]) + "".join(words), "n": rng.random()})
        carried = orjson.loads(orjson.dumps(delta(previous, current).decode())).encode()
        assert centrifuge.apply_delta(previous, carried) == current


def test_centrifuge_applies_our_deltas_of_binary_pairs():
    rng = random.Random(6)
    for _ in range(200):
        previous = rng.randbytes(rng.randint(0, 2000))
        current = bytearray(previous)
        for _ in range(rng.randint(0, 5)):
            start = rng.randint(0, len(current))
            current[start : start + rng.randint(0, 40)] = rng.randbytes(rng.randint(0, 40))
        assert centrifuge.apply_delta(previous, delta(previous, bytes(current))) == current


def test_the_checksums_agree():
    rng = random.Random(7)
    for size in [*range(0, 40), 1000, 4097]:
        data = rng.randbytes(size)
        assert checksum(data) == centrifuge.checksum(data)
