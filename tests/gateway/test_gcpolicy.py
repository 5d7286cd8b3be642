"""The collector policy freezes long-lived objects yet still reclaims cyclic garbage on its full collection."""

import asyncio
import gc
import sys
import weakref

import pytest

from gateway.ops.gcpolicy import GcPolicy

pytestmark = pytest.mark.unit


class Node:
    pass


def test_frozen_cycles_are_reclaimed_by_the_periodic_full_collection():
    async def scenario():
        node = Node()
        node.me = node  # a cycle: only a full collection can free it
        ref = weakref.ref(node)
        policy = GcPolicy(full_interval_s=3600)
        policy.start()
        try:
            assert gc.get_freeze_count() > 0
            del node
            gc.collect()
            assert ref() is not None  # frozen: out of the automatic collector's reach
            policy.full_collection()
            assert ref() is None and policy.full_collections == 1
            assert policy.pauses[2].counts and sum(policy.pauses[2].counts) >= 1
        finally:
            policy.stop()
        assert gc.get_freeze_count() == 0

    asyncio.run(scenario())


def test_interval_zero_keeps_the_default_collector():
    async def scenario():
        policy = GcPolicy(full_interval_s=0)
        policy.start()
        try:
            assert gc.get_freeze_count() == 0
            gc.collect()
            assert sum(policy.pauses[2].counts) >= 1  # pauses are still measured
        finally:
            policy.stop()

    asyncio.run(scenario())


def test_a_crowd_that_leaves_is_collected_at_the_next_tick_not_the_interval(monkeypatch):
    from gateway.ops import gcpolicy

    tick = 0.05  # the policy's tick (1 s in service), shortened: the test counts ticks, not seconds
    monkeypatch.setattr(gcpolicy, "FREEZE_PERIOD_S", tick)

    async def scenario():
        policy = GcPolicy(full_interval_s=3600)
        policy.start()
        try:
            for _ in range(gcpolicy.DEPARTURES_MIN * 2):
                policy.arrived()
            policy.full_collection()  # the crowd is open at this full collection
            assert policy.full_collections == 1
            for _ in range(gcpolicy.DEPARTURES_MIN - 1):
                policy.departed()
            await asyncio.sleep(tick * 4)  # ticks that could collect, and must not
            assert policy.full_collections == 1  # fewer than half left: the interval's collection will do
            policy.departed()
            deadline = asyncio.get_running_loop().time() + 5  # the interval is an hour: a collection now is a tick's
            while policy.full_collections == 1 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(tick / 5)  # one tick sees the last departure, the next runs it
            assert policy.full_collections == 2 and policy.open == gcpolicy.DEPARTURES_MIN
        finally:
            policy.stop()

    asyncio.run(scenario())


def test_the_interval_collection_waits_while_no_connection_closes():
    from gateway.ops import gcpolicy

    policy = GcPolicy(full_interval_s=60)
    policy._next_full = 1000.0  # the last full collection ran at 940
    assert not policy._interval_due(999.0)
    assert not policy._interval_due(1000.0)  # an interval without a departure: nothing to reclaim
    assert policy._interval_due(1000.0 + (gcpolicy.QUIET_INTERVALS - 1) * 60)  # ... but at most this long
    policy.arrived()
    policy.departed()
    assert policy._interval_due(1000.0) and not policy._interval_due(999.0)


def test_a_full_collection_lets_go_of_the_names_the_type_cache_kept():
    # CPython 3.11 keeps a reference to each looked-up attribute name in its type cache, even a name made at
    # run time (as C code's lookups by C string are): a crowd's worth of those pinned arenas after it left
    class Holder:
        attr = 1

    async def scenario():
        name = "".join(["at", "tr"])  # built at run time: not the interned constant
        unheld = sys.getrefcount(name)
        getattr(Holder(), name)
        if sys.getrefcount(name) == unheld:
            pytest.skip("this CPython's type cache keeps no reference to the names it looks up")
        policy = GcPolicy(full_interval_s=3600)
        policy.start()
        try:
            policy.full_collection()
            assert sys.getrefcount(name) == unheld
        finally:
            policy.stop()

    asyncio.run(scenario())
