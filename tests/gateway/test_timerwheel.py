"""The timer wheel (gateway/timerwheel.py): the deadlines of many connections on one loop timer. Deadlines fire
in order, never early and at most a tick late; cancelling and moving work, also from inside a firing tick;
a tick costs what is due in it, whatever else waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.timerwheel import TimerWheel

pytestmark = pytest.mark.unit

TICK = 0.01


def run(coro):
    return asyncio.run(coro)


class Recorder:
    def __init__(self) -> None:
        self.fired: list[tuple[object, object, float]] = []

    def __call__(self, key: object, value: object) -> None:
        self.fired.append((key, value, asyncio.get_running_loop().time()))

    @property
    def keys(self) -> list[object]:
        return [key for key, _, _ in self.fired]


def test_deadlines_fire_in_order_never_early_and_at_most_a_tick_late():
    async def main():
        record = Recorder()
        wheel = TimerWheel(record, TICK)
        loop = asyncio.get_running_loop()
        start = loop.time()
        delays = {"a": 0.08, "b": 0.02, "c": 0.05, "d": 0.0, "e": 0.05}
        for key, delay in delays.items():
            wheel.schedule(key, delay, delay)
        assert len(wheel) == 5 and "a" in wheel
        await asyncio.sleep(0.2)
        assert record.keys == ["d", "b", "c", "e", "a"]  # by deadline; c and e (one tick) as scheduled
        for key, delay, at in record.fired:
            assert delay == delays[key]  # each deadline's own value
            assert at >= start + delay - 0.001  # the loop's timers are whole milliseconds (uvloop)
            assert at <= start + delay + TICK + 0.05  # a tick late at most, plus the loop's own lateness
        assert len(wheel) == 0 and "a" not in wheel

    run(main())


def test_cancel_and_reschedule():
    async def main():
        record = Recorder()
        wheel = TimerWheel(record, TICK)
        wheel.schedule("gone", 0.02, 1)
        wheel.schedule("moved", 0.02, 1)
        wheel.schedule("kept", 0.03, 1)
        assert wheel.cancel("gone") and not wheel.cancel("gone") and not wheel.cancel("never")
        assert wheel.get("moved") == 1
        wheel.schedule("moved", 0.08, 2)  # a key holds one deadline: scheduling again moves it
        assert wheel.get("moved") == 2 and wheel.get("gone") is None
        await asyncio.sleep(0.05)
        assert record.keys == ["kept"]
        await asyncio.sleep(0.1)
        assert record.keys == ["kept", "moved"] and record.fired[1][1] == 2
        wheel.schedule("late", 10.0, 0)
        wheel.close()  # forgets everything, stops its loop timer
        assert len(wheel) == 0

    run(main())


def test_what_a_firing_deadline_does_to_others():
    async def main():
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        times: dict[str, float] = {}

        def fire(key: str, _: None) -> None:
            fired.append(key)
            times.setdefault(key, loop.time())
            if key == "first" and fired.count("first") == 1:
                wheel.cancel("second")  # same tick, not fired yet: it never fires
                wheel.schedule("third", 0.05, None)  # moved later
                wheel.schedule("first", 0.0, None)  # itself again at once: the next tick, not this one
            if key == "boom":
                raise RuntimeError("one deadline fails")

        wheel: TimerWheel[str, None] = TimerWheel(fire, TICK)
        for key in ("first", "second", "third", "boom", "after"):
            wheel.schedule(key, 0.02, None)
        await asyncio.sleep(0.15)
        assert fired == ["first", "boom", "after", "first", "third"]  # a failure does not stop the others
        assert times["third"] - times["first"] >= 0.05 - 0.001

    run(main())


def test_a_tick_costs_what_is_due_not_what_waits():
    async def main():
        fired: list[int] = []
        wheel: TimerWheel[int, None] = TimerWheel(lambda key, _: fired.append(key), TICK)
        for key in range(100_000):  # idle connections: a deadline far away each
            wheel.schedule(key, 1000.0, None)
        waiting = len(wheel._buckets)  # a few: the ticks the scheduling took
        for key in range(-5, 0):
            wheel.schedule(key, 0.02, None)
        started = time.perf_counter()
        await asyncio.sleep(0.1)
        assert sorted(fired) == [-5, -4, -3, -2, -1]
        # a loop timer per tick due: one, or two when a slow machine let a tick end between the five schedules
        assert wheel.fired == 5 and wheel.wakeups <= 2
        assert len(wheel) == 100_000 and len(wheel._buckets) == waiting  # the waiting ones untouched
        assert time.perf_counter() - started < 0.5

    run(main())


def test_deadlines_of_one_tick_share_a_bucket_and_a_wake_up():
    async def main():
        fired: list[int] = []
        wheel: TimerWheel[int, None] = TimerWheel(lambda key, _: fired.append(key), 0.25)
        for key in range(10_000):
            wheel.schedule(key, 0.1, None)
        assert len(wheel._buckets) <= 2 and wheel._handle is not None  # one loop timer for them all
        await asyncio.sleep(0.6)
        assert fired == list(range(10_000)) and wheel.wakeups <= 2

    run(main())


def test_resolution_must_be_positive():
    with pytest.raises(ValueError):
        TimerWheel(lambda key, value: None, 0.0)
