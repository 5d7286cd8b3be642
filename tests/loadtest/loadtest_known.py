"""A small delivery log whose every figure is worked out by hand (see the comments)."""

from __future__ import annotations

import numpy as np

from loadtest.delivery_stats import DeliveryLog, Notices
from loadtest.scenarios import ClientPlan, Plan

MS = 1_000_000
TOPICS = ("a", "b")
CLIENTS = ("c0", "c1", "c2")

# topic a: seqs 0..4 published 10 ms apart; c0 gets all 1 ms after, c1 3 ms after, c2 gets 0, 1, 4 5 ms after
# (c2 is told about seq 2 only: seq 3 is a silent loss). Topic b (c0 only, stream starts at 10): 10, 12, 12
# 2 ms after (11 silent, the second 12 a duplicate); 15 were published on b, 14 is announced, 13 never came.
_ROWS = [
    # client, topic, seq, latency ms, batch
    *[(0, 0, s, 1, 1 if s < 2 else 2) for s in range(5)],
    *[(0, 1, s, 2, b) for s, b in ((10, 3), (12, 4), (12, 4))],
    *[(1, 0, s, 3, s + 1) for s in range(5)],
    *[(2, 0, s, 5, b) for s, b in ((0, 1), (1, 2), (4, 3))],
]
_PUBLISH = {(0, s): 1_000 * MS + s * 10 * MS for s in range(5)} | {(1, s): 2_000 * MS + s * MS for s in range(10, 15)}


def log() -> DeliveryLog:
    client = np.array([r[0] for r in _ROWS], np.int32)
    topic = np.array([r[1] for r in _ROWS], np.int32)
    seq = np.array([r[2] for r in _ROWS], np.int64)
    publish = np.array([_PUBLISH[(r[1], r[2])] for r in _ROWS], np.int64)
    deliver = publish + np.array([r[3] * MS for r in _ROWS], np.int64)
    batch = np.array([r[4] for r in _ROWS], np.int64)
    return DeliveryLog(TOPICS, CLIENTS, topic, seq, client, publish, deliver, batch)


def notices() -> Notices:
    # c2 on a: [2, 3) lagged; c0 on b: [14, 15) lagged; c1 on b: an epoch restart (open range)
    return Notices(
        np.array([2, 0, 1], np.int32),
        np.array([0, 1, 1], np.int32),
        np.array([2, 14, 5], np.int64),
        np.array([3, 15, -1], np.int64),
        ("lagged", "lagged", "epoch"),
    )


STARTS = {(0, 0): 0, (1, 0): 0, (2, 0): 0, (0, 1): 10}
EXPECTED_END = {0: 5, 1: 15}
PUBLISHED = {"a": 5, "b": 5}

# latencies (ms): 1 x5, 2 x3, 3 x5, 5 x3 -> nearest rank over 16: p50 = 8th = 2, p90 = 15th = 5, p99 = 5
LATENCY_MS = {"n": 16, "p50": 2.0, "p90": 5.0, "p99": 5.0, "max": 5.0, "mean": 41 / 16}
# skew per message of a (max - min over clients): seq 0, 1, 4: 5 - 1 = 4 ms; seq 2, 3: 3 - 1 = 2 ms.
# b is seen by one client only: no skew. Sorted [2, 2, 4, 4, 4]: p50 = 3rd = 4
SKEW_MS = [2, 2, 4, 4, 4]
# batches: c0 {a1: 2, a2: 3, b3: 1, b4: 2}, c1 five of 1, c2 three of 1
BATCH_SIZES = sorted([2, 3, 1, 2] + [1] * 8)
# per-client deliveries 8, 5, 3: (16^2) / (3 * (64 + 25 + 9))
JAIN = 256 / 294


def plan() -> Plan:
    return Plan(
        TOPICS,
        (1.0, 1.0),
        ("hot", "cold"),
        (
            ClientPlan("c0", "ws", "light", (0, 1)),
            ClientPlan("c1", "ws", "light", (0,)),
            ClientPlan("c2", "longpoll", "light", (0,)),
        ),
    )
