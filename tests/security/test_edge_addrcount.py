"""The shared per-address counters (gateway/edge/addrcount.py) used the way the limiter and the hub use a Counter,
by two workers: real forked processes sharing the mapping, and two views in one process."""

from __future__ import annotations

import copy
import os

from gateway.edge.addrcount import SharedCounts


def views(workers: int = 2) -> list[SharedCounts]:
    shared = SharedCounts(workers, slots=1 << 10)
    out = []
    for index in range(workers):
        view = copy.copy(shared)  # the same columns; its own index, as after a fork
        view.bind(index)
        out.append(view)
    return out


def test_counts_read_the_cluster_and_writes_stay_exact_per_worker():
    a, b = (view.counter("connections") for view in views())
    for _ in range(3):
        a["1.2.3.4"] += 1
    b["1.2.3.4"] += 1
    assert a["1.2.3.4"] == 4 and b["1.2.3.4"] == 4
    assert a.own("1.2.3.4") == 3 and b.own("1.2.3.4") == 1
    # the limiter's release: left = c[ip] - 1; c[ip] = left, or del when nothing is left
    left = b["1.2.3.4"] - 1
    b["1.2.3.4"] = left
    assert b.own("1.2.3.4") == 0 and "1.2.3.4" not in b and a["1.2.3.4"] == 3
    for _ in range(3):
        left = a["1.2.3.4"] - 1
        if left:
            a["1.2.3.4"] = left
        else:
            del a["1.2.3.4"]
    assert a["1.2.3.4"] == 0 and b["1.2.3.4"] == 0 and not a and not b
    # the hub's keys are tuples, in another namespace than the limiter's
    hub_a = views()[0].counter("clients")
    hub_a[("sse", "1.2.3.4")] += 1
    assert hub_a[("sse", "1.2.3.4")] == 1 and hub_a[("longpoll", "1.2.3.4")] == 0


def test_another_worker_changing_its_count_between_our_read_and_write_is_not_taken_for_ours():
    a_view, b_view = views()
    a, b = a_view.counter("c"), b_view.counter("c")
    seen = a["k"]  # a reads (0) ...
    b["k"] += 5  # ... b admits five meanwhile ...
    a["k"] = seen + 1  # ... a writes its read + 1: its own count is 1, not 1 - 5
    assert a.own("k") == 1 and b.own("k") == 5 and a["k"] == 6


def test_forked_workers_share_the_counts():
    shared = SharedCounts(2, slots=1 << 10)
    shared.bind(0)
    ours = shared.counter("connections")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # worker 1
        try:
            shared.bind(1)
            theirs = shared.counter("connections")
            for _ in range(7):
                theirs["10.0.0.1"] += 1
            os.write(write, b"%d" % theirs["10.0.0.1"])
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"7"
    os.waitpid(pid, 0)
    assert ours["10.0.0.1"] == 7 and ours.own("10.0.0.1") == 0
    ours["10.0.0.1"] += 1
    assert ours["10.0.0.1"] == 8


def test_shared_token_buckets_count_every_workers_takes_and_refill_at_the_rate():
    now = [1000.0]
    a, b = (view.rate("token_check", 2.0, 4, clock=lambda: now[0]) for view in views())
    assert [a.take("ip"), b.take("ip"), a.take("ip"), b.take("ip"), a.take("ip"), b.take("ip")] == [True] * 4 + [False] * 2
    assert a.take("other") and b.tokens("other") == 3  # another address, another bucket
    now[0] += 1.0  # 2 tokens back, whoever reads
    assert b.tokens("ip") == 2 and b.take("ip") and a.take("ip") and not b.take("ip")
    now[0] += 100.0  # refilled to the burst, never beyond
    assert a.tokens("ip") == 4
    c, d = (view.rate("topic_create", 0.0, 2, clock=lambda: now[0]) for view in views())
    c.charge("ip")
    d.charge("ip")
    d.charge("ip")  # past empty: stays empty
    now[0] += 1e6
    assert c.tokens("ip") == 0 and d.tokens("ip") == 0  # rate 0: no refill
