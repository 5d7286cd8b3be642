"""The crowd scenarios' parts, fed directly: the plan, source addresses, the shipped gateway config, the
figures (time to last, window peaks), a reconnect's bookkeeping in the recorder and the storm figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from gateway.config import load_config
from loadtest import analysis, delivery_stats, gatewayproc, scenarios
from loadtest.delivery_stats import DeliveryLog, Notices
from loadtest.recorder import Recorder

pytestmark = pytest.mark.unit


def test_crowd_and_rooms_deliver_the_same_per_second() -> None:
    crowd, rooms = scenarios.SCENARIOS["crowd"], scenarios.SCENARIOS["rooms"]
    for s in (crowd, rooms):
        assert (s.clients, s.subs, s.shipped, s.payload) == (10_000, 1, True, scenarios.PAYLOAD_100)
        assert s.clients / s.source_addrs < 256  # the shipped server.max_connections_per_ip holds
    assert crowd.topics == 1 and crowd.rate == 5
    assert rooms.topics == 1000 and rooms.rate == 5 * rooms.topics
    # deliveries/s: each client gets its one topic's messages
    assert crowd.rate * crowd.clients == rooms.rate / rooms.topics * rooms.clients == 50_000


def test_one_topic_each_deals_clients_into_equal_rooms() -> None:
    plan = scenarios.plan(dataclasses.replace(scenarios.SCENARIOS["rooms"], clients=3000))
    sizes = np.bincount([c.topics[0] for c in plan.clients], minlength=1000)
    assert sizes.min() == sizes.max() == 3
    assert plan.rates == (5.0,) * 1000


def test_source_addresses_are_distinct_loopback_addresses() -> None:
    addresses = [scenarios.source_addr(k) for k in range(scenarios.MAX_SOURCE_ADDRS)]
    assert len(set(addresses)) == len(addresses)
    assert addresses[0] == "127.0.1.1" and addresses[253] == "127.0.1.254" and addresses[254] == "127.0.2.1"
    assert all(a.startswith("127.0.") and "127.0.0." not in a for a in addresses)
    assert addresses[-1] == "127.0.254.254"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"capacity": 128}, "no-shipped"),
        ({"batch_depth": 8}, "no-shipped"),
        ({"storm_at": 16.0}, "storm_spread must be below"),
        ({"storm_at": 1.0, "transport": "longpoll"}, "WebSocket"),
        ({"storm_at": 1.0, "stall_frac": 0.1}, "stalls"),
        ({"source_addrs": scenarios.MAX_SOURCE_ADDRS + 1}, "source_addrs"),
        ({"workers": 0}, "workers"),
    ],
)
def test_crowd_scenarios_refuse_what_they_cannot_run(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(scenarios.SCENARIOS["crowd"], **changes).validate()


def test_shipped_config_overrides_only_ports_token_and_connections(tmp_path: Path) -> None:
    shipped = load_config()
    assert shipped.server.max_connections == gatewayproc.SHIPPED_MAX_CONNECTIONS
    assert shipped.topics["rules"][-1]["pattern"] == "*"
    assert shipped.topics["rules"][-1]["capacity"] == scenarios.SHIPPED_CAPACITY

    assert gatewayproc.shipped_max_connections(100) is None
    assert gatewayproc.shipped_max_connections(10_000) == 10_000 + gatewayproc.CONNECTION_MARGIN
    path = tmp_path / "gateway.toml"
    path.write_text(gatewayproc.shipped_config_text("tok", gatewayproc.shipped_max_connections(10_000)))
    config = load_config(path, environ={})
    assert (config.server.port, config.ingest.port, config.rawtcp.sender_port, config.rawtcp.receiver_port) == (0,) * 4
    assert config.server.admin_token == "tok" and config.server.max_connections == 10_064
    assert config.server.max_connections_per_ip == shipped.server.max_connections_per_ip == 256
    assert config.topics == shipped.topics and config.limits == shipped.limits
    assert config.server.workers == 1 and not config.broker.url

    path.write_text(gatewayproc.shipped_config_text("tok", None, workers=2, broker_url="redis://127.0.0.1:1/0"))
    config = load_config(path, environ={})
    assert config.server.workers == 2 and config.broker.url == "redis://127.0.0.1:1/0"
    assert config.server.max_connections == shipped.server.max_connections


def test_time_to_last_is_the_latest_delivery_of_each_publish() -> None:
    # message (t0, 0) published at 100, delivered at 110 and 150; (t0, 1) at 200 -> 205; (t1, 0) unstamped
    log = DeliveryLog(
        ("t0", "t1"),
        ("a", "b"),
        np.array([0, 0, 0, 1], np.int32),
        np.array([0, 0, 1, 0], np.int64),
        np.array([0, 1, 0, 0], np.int32),
        np.array([100, 100, 200, -1], np.int64),
        np.array([110, 150, 205, 300], np.int64),
        np.zeros(4, np.int64),
    )
    assert sorted(delivery_stats.time_to_last(log).tolist()) == [5, 50]
    assert delivery_stats.window_peak(np.array([0, 5, 9, 10, 30], np.int64), 10) == 3
    assert delivery_stats.window_peak(np.zeros(0, np.int64), 10) == 0


def test_a_resubscribe_keeps_the_stream_start_and_is_recorded() -> None:
    rec = Recorder({"t": 0}, [False, False])
    rec.entries(0, [{"type": "subscribed", "topic": "t", "kind": "ring", "epoch": "e1", "seq": 5}], 1, 10)
    rec.entries(
        0,
        [
            {"type": "msg", "topic": "t", "seq": 5, "data": {"ts": 1, "n": 0}},
            {"type": "msg", "topic": "t", "seq": 6, "data": {"ts": 1, "n": 1}},
        ],
        2,
        11,
    )
    rec.entries(1, [{"type": "subscribed", "topic": "t", "kind": "ring", "epoch": "e1", "seq": 5}], 1, 10)
    rec.entries(1, [{"type": "loss", "topic": "t", "from": 5, "to": 9, "reason": "lagged"}], 2, 11)
    assert rec.epochs == {(0, 0): "e1", (1, 0): "e1"}
    assert rec.next_seqs({0, 1}) == {(0, 0): 7, (1, 0): 9}
    assert rec.next_seqs({0}) == {(0, 0): 7}

    rec.resuming[(0, 0)] = 7
    rec.entries(
        0,
        [
            {"type": "subscribed", "topic": "t", "kind": "ring", "epoch": "e1", "seq": 7},
            {"type": "msg", "topic": "t", "seq": 7, "data": {"ts": 1, "n": 2}},
        ],
        3,
        20,
    )
    assert rec.starts[(0, 0)] == 5  # a gap across the reconnect still shows
    assert rec.resumes == [(0, 0, 7, 7, 20)] and not rec.resuming


#: the storm data's time unit: a millisecond in ns
MS = 1_000_000


def _storm_data(seqs: list[int], since: int, answered: int) -> analysis.RunData:
    """One client: seqs 0..2 before a storm at t=1000 ms, back (open 1100, resubscribe 1110, subscribed 1120),
    then ``seqs`` delivered at 1130, 1131, ... ms; seqs below 5 published at 10 x seq ms (before the storm),
    the others at 1115 + seq (after the resubscribe left: live, not replayed)."""
    all_seqs = [0, 1, 2] + seqs
    n = len(all_seqs)
    deliver = [10 * s + 1 for s in (0, 1, 2)] + [1130 + i for i in range(len(seqs))]
    publish = [10 * s if s < 5 else 1115 + s for s in all_seqs]
    log = DeliveryLog(
        ("t",),
        ("c0",),
        np.zeros(n, np.int32),
        np.array(all_seqs, np.int64),
        np.zeros(n, np.int32),
        np.array(publish, np.int64) * MS,
        np.array(deliver, np.int64) * MS,
        np.arange(n, dtype=np.int64),
    )
    storm = {
        "storm_ns": 1000 * MS,
        "retry_ns": 1050 * MS,
        "open_ns": 1100 * MS,
        "resub_ns": 1110 * MS,
        "back_ns": 1120 * MS,
        "attempts": 1,
        "error": "",
    }
    return analysis.RunData(
        log,
        Notices.empty(),
        {(0, 0): 0},
        {0: {"ready": True, "storm": storm}},
        {"accepted": {"t": 200}},
        [],
        ((0, 0, since, answered, 1120 * MS),),
    )


def test_storm_figures_pass_a_clean_recovery_and_catch_a_gap_or_duplicate() -> None:
    scenario = dataclasses.replace(scenarios.SCENARIOS["crowd"], storm_at=1.0, storm_spread=0.5)
    clean = _storm_data([3, 4, 5], 3, 3)
    loss = delivery_stats.loss_figures(clean.log, clean.notices, clean.starts)
    storm = analysis.storm_figures(clean, scenario, loss)
    assert storm["ok"] and (storm["clients"], storm["back"], storm["not_back"]) == (1, 1, 0)
    # caught up: the last message published before the resubscribe left (seq 4, published 40) came at 1131
    assert storm["replayed"] == 2 and storm["last_caught_up_s"] == 0.131
    assert storm["last_back_s"] == 0.12 and storm["reconnect_ms"]["max"] == 70
    assert storm["accept_per_s"]["offered"] == 2.0 and storm["accept_per_s"]["peak_1s"] == 1

    for seqs, since, answered in (([4, 5], 3, 3), ([2, 3], 2, 2), ([3, 4], 3, 4)):
        data = _storm_data(seqs, since, answered)
        loss = delivery_stats.loss_figures(data.log, data.notices, data.starts)
        assert not analysis.storm_figures(data, scenario, loss)["ok"], (seqs, since, answered)
