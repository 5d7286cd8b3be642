"""Stored entries weigh what they hold: the encoder's spare buffer is not kept alive by a ring."""

import tracemalloc

import pytest

from core import Engine
from core.config import TopicConfig

pytestmark = pytest.mark.unit


def test_a_ring_of_small_messages_holds_about_their_size():
    engine = Engine()
    engine.create_topic("t", TopicConfig(capacity=1000))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):
            engine.publish("t", {"bid": i})
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # ~45-byte entries: a few hundred bytes each with the bytes header and the ring's bookkeeping,
    # where an over-allocated encoder buffer would hold 4 KiB each
    assert held < 1000 * 400, held
