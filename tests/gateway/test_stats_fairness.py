"""The dashboard's fairness figure, computed by hand (gateway/stats_feed.py): each client's share of what it
asked for in a stats window, delivered / (delivered + still waiting), and Jain's index of the shares from
their count, sum and sum of squares (so a cluster's is exact from its nodes' sums)."""

from __future__ import annotations

import pytest

from gateway.stats_feed import delivery_share, jain

pytestmark = pytest.mark.unit


def index(shares: list[float]) -> float | None:
    return jain(len(shares), sum(shares), sum(x * x for x in shares))


def test_a_client_share_is_what_it_got_of_what_it_was_owed():
    assert delivery_share(50, 0) == 1.0  # caught up, whatever its rate
    assert delivery_share(1, 0) == 1.0
    assert delivery_share(0, 40) == 0.0  # stalled: entries wait, none taken
    assert delivery_share(30, 10) == 0.75
    assert delivery_share(0, 0) is None  # asked for nothing: left out, neither 0 nor 1


def test_jain_of_the_shares_by_hand():
    # caught-up clients at very different rates (5, 50, 500 entries in the window): all 1.0
    shares = [delivery_share(n, 0) for n in (5, 50, 500)]
    assert shares == [1.0, 1.0, 1.0] and index([1.0, 1.0, 1.0]) == 1.0
    # three caught up, one stalled: (1+1+1+0)^2 / (4 * 3) = 9/12
    assert index([1.0, 1.0, 1.0, 0.0]) == 0.75
    # shares 1.0 and 0.5: 1.5^2 / (2 * 1.25) = 2.25/2.5
    assert index([1.0, 0.5]) == 0.9
    # shares 0.75, 1.0, 0.25: 2^2 / (3 * (0.5625 + 1 + 0.0625)) = 4/4.875 = 0.82051...
    assert index([0.75, 1.0, 0.25]) == 0.8205
    # one has everything: 1/n
    assert index([1.0, 0.0, 0.0, 0.0, 0.0]) == 0.2
    # all equal, all stalled included: 1.0 (as the load tool's jain); nobody counted: no figure
    assert index([0.0, 0.0]) == 1.0
    assert index([]) is None


def test_a_cluster_index_from_its_nodes_sums_is_the_index_of_all_its_clients():
    node_a, node_b = [1.0, 0.5], [0.75, 1.0, 0.25]
    sums = [(len(s), sum(s), sum(x * x for x in s)) for s in (node_a, node_b)]
    merged = jain(sum(n for n, _, _ in sums), sum(t for _, t, _ in sums), sum(q for _, _, q in sums))
    # 3.5^2 / (5 * (1 + 0.25 + 0.5625 + 1 + 0.0625)) = 12.25 / 14.375 = 0.85217...
    assert merged == index(node_a + node_b) == 0.8522
