"""The answer of GET /readyz in each state (gateway/ops/readiness.py); the real transitions are shown on real
processes in tests/gateway/test_readyz.py (SIGTERM) and tests/cluster/test_readyz_broker.py (Redis)."""

from __future__ import annotations

import pytest

from gateway.ops.readiness import Readiness

pytestmark = pytest.mark.unit


def test_starting_then_ready_then_broker_unavailable_and_back_then_draining_for_good():
    broker = [True]
    readiness = Readiness(lambda: broker[0], worker=3)
    assert readiness.answer() == (
        503,
        {"status": "unavailable", "reason": "starting", "worker": 3, "pid": readiness.answer()[1]["pid"]},
    )
    readiness.started = True
    assert readiness.answer()[0] == 200 and "reason" not in readiness.answer()[1]
    broker[0] = False
    assert readiness.answer()[0] == 503 and readiness.reason() == "broker_unavailable"
    broker[0] = True
    assert readiness.reason() is None
    readiness.draining = True
    broker[0] = False
    assert readiness.reason() == "draining"  # outranks the rest: it never ends


def test_the_gauge_says_what_readyz_says():
    broker = [True]
    readiness = Readiness(lambda: broker[0])

    def sample() -> tuple[dict[str, str], float]:
        (family,) = readiness.collect()
        (point,) = family.samples
        return point.labels, point.value

    assert sample() == ({"reason": "starting"}, 0)
    readiness.started = True
    assert sample() == ({"reason": ""}, 1)
    broker[0] = False
    assert sample() == ({"reason": "broker_unavailable"}, 0)
