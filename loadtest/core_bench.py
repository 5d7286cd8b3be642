"""Benchmark of the sans-I/O core: `python -m loadtest core [--scale 0.1]`.

Prints, as ratios measured in one run where they matter:
* publish cost with 1 vs 10,000 active subscribers, and with 10,000 caught-up (idle) subscribers;
* run_cycle cost for 100 active clients alone vs beside 10,000 idle clients (target ratio <= 1.2);
* entries emitted per second by run_cycle for 1,000 clients x 10 topics;
* memory per (client, topic) subscription with 10,000 clients x 100 topics (target: a cursor, not a queue).
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

from core import Engine, EngineConfig, TopicConfig, TopicRule

RING = EngineConfig(rules=(TopicRule("*", TopicConfig(capacity=64)),), max_subscriptions=1000)


def _engine() -> Engine:
    return Engine(RING, instance_id="bench")


def _settle() -> None:
    """Move setup objects out of the collector's way, as they are in a long-running gateway's old generation."""
    gc.collect()
    gc.freeze()


def _drain(engine: Engine) -> int:
    entries = 0
    for batch in engine.run_cycle():
        entries += len(batch.entries)
        engine.write_done(batch.client_id)
    return entries


def _subscribe_all(engine: Engine, clients: int, topics: int) -> None:
    """Connect `clients`, each subscribed to topics t0..t{topics-1}, and write their acks."""
    for c in range(clients):
        engine.connect(c)
        for t in range(topics):
            engine.subscribe(c, f"t{t}")
    while _drain(engine):
        pass


def publish_cost(subscribers: int, publishes: int, caught_up: bool) -> float:
    """Microseconds per publish. caught_up: a cycle runs between publishes so every subscriber is idle."""
    engine = _engine()
    for c in range(subscribers):
        engine.connect(c)
        engine.subscribe(c, "t")
    while _drain(engine):
        pass
    _settle()
    if not caught_up:
        engine.publish("t", 0)  # wakes everyone once; later publishes find them all active
    total = 0.0
    for i in range(publishes):
        start = time.perf_counter()
        engine.publish("t", i)
        total += time.perf_counter() - start
        if caught_up:
            while _drain(engine):
                pass
    return total / publishes * 1e6


def cycle_cost(active: int, idle: int, rounds: int) -> float:
    """Microseconds per run_cycle serving `active` clients while `idle` others are connected and subscribed."""
    engine = _engine()
    for c in range(active + idle):
        engine.connect(c)
        engine.subscribe(c, "hot" if c < active else f"cold{c % 100}")
    while _drain(engine):
        pass
    _settle()
    total = 0.0
    for i in range(rounds):
        engine.publish("hot", i)
        start = time.perf_counter()
        batches = engine.run_cycle()
        total += time.perf_counter() - start
        assert len(batches) == active
        for batch in batches:
            engine.write_done(batch.client_id)
    return total / rounds * 1e6


def emit_rate(clients: int, topics: int, rounds: int) -> tuple[float, float]:
    """(entries emitted per second of run_cycle time, entries per batch) for clients x topics, all hot."""
    engine = _engine()
    _subscribe_all(engine, clients, topics)
    _settle()
    entries = batches_n = 0
    elapsed = 0.0
    for i in range(rounds):
        for t in range(topics):
            engine.publish(f"t{t}", i)
        start = time.perf_counter()
        batches = engine.run_cycle()
        elapsed += time.perf_counter() - start
        batches_n += len(batches)
        for batch in batches:
            entries += len(batch.entries)
            engine.write_done(batch.client_id)
    return entries / elapsed, entries / max(batches_n, 1)


def memory_per_subscription(clients: int, topics: int) -> float:
    """Bytes of Python heap per (client, topic) subscription, messages excluded."""
    gc.collect()
    tracemalloc.start()
    engine = _engine()
    for t in range(topics):
        engine.create_topic(f"t{t}")
    base, _ = tracemalloc.get_traced_memory()
    _subscribe_all(engine, clients, topics)  # acks are written: only subscription state remains
    gc.collect()
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # Client objects and their containers are included, spread over all subscriptions.
    return (used - base) / (clients * topics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest core", description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="scale client counts (0.1 for a quick run)")
    args = parser.parse_args(argv)
    many = max(100, int(10_000 * args.scale))
    print(f"core benchmark (scale {args.scale}: {many} = '10,000')")

    one = publish_cost(1, 2000, caught_up=False)
    many_active = publish_cost(many, 2000, caught_up=False)
    print(f"publish, 1 active subscriber:          {one:8.2f} us")
    print(f"publish, {many} active subscribers:  {many_active:8.2f} us   ratio {many_active / one:.2f} (O(1))")
    many_idle = publish_cost(many, 50, caught_up=True)
    print(f"publish, {many} caught-up subscribers: {many_idle:8.1f} us   {many_idle * 1000 / many:.0f} ns per woken subscriber")

    alone = cycle_cost(100, 0, 2000)
    beside = cycle_cost(100, many, 2000)
    print(f"run_cycle, 100 active alone:           {alone:8.1f} us")
    print(f"run_cycle, 100 active beside {many} idle: {beside:8.1f} us   ratio {beside / alone:.2f} (target <= 1.2)")

    n_clients = max(100, int(1000 * args.scale))
    rate, per_batch = emit_rate(n_clients, 10, 50)
    print(f"run_cycle, {n_clients} clients x 10 topics:   {rate:,.0f} entries/s, {per_batch:.1f} entries per batch")

    mem_clients = max(100, int(10_000 * args.scale))
    per_sub = memory_per_subscription(mem_clients, 100)
    print(f"memory, {mem_clients} clients x 100 topics:  {per_sub:.0f} bytes per subscription (a cursor, no queue)")


if __name__ == "__main__":
    main()
