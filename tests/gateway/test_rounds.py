"""Scheduler rounds (gateway/transports/staging.py): under a backlog several cycles go out in one write per client.

The frames are the cycles' own (one message per frame at depth 1, in order, nothing lost); the knob set to
1 writes every cycle at once; a client left above its high-water mark by a round's write is not ready until
it drains, and nobody else waits for it.
"""

import contextlib
import json

import pytest
from websockets.exceptions import ConnectionClosed

from gateway import close_codes
from gateway.testing import run_gateway
from tests.gateway.gw_helpers import collect, metric, recv_entries, send, wait_for, ws_connect

pytestmark = pytest.mark.timeout(60)

RULES = {"rules": [{"pattern": "*", "anonymous": True, "capacity": 1024}]}
BACKLOG = 200


def publish_backlog(gw, topic: str, count: int) -> None:
    """Publish `count` messages in one loop callback: the whole backlog is there before the next cycle."""
    gw.call(lambda: [gw.hub.catalog.publish_nowait(topic, i) for i in range(count)])


def subscribed_clients(gw, stack: contextlib.ExitStack, count: int):
    clients = [stack.enter_context(ws_connect(gw)) for _ in range(count)]
    for ws in clients:
        send(ws, op="subscribe", topic="feed")
        assert recv_entries(ws)[0]["type"] == "subscribed"
    return clients


def one_message_per_frame(ws, count: int) -> list[int]:
    seqs: list[int] = []
    while len(seqs) < count:
        entries = recv_entries(ws)
        assert len(entries) == 1, entries  # depth 1: one message per cycle, so per frame
        assert entries[0]["type"] == "msg"
        seqs.append(entries[0]["seq"])
    return seqs


@pytest.mark.parametrize("cycles", [8, 1])
def test_a_backlog_goes_out_in_rounds_of_cycles_with_the_frames_unchanged(cycles):
    settings = {"write_coalesce_cycles": cycles, "write_coalesce_ms": 1000}
    with run_gateway(topics=RULES, scheduler=settings) as gw, contextlib.ExitStack() as stack:
        clients = subscribed_clients(gw, stack, 3)
        rounds_before, writes_before = metric(gw, "fanout_rounds_total"), metric(gw, "fanout_staged_writes_total")
        publish_backlog(gw, "feed", BACKLOG)
        for ws in clients:
            assert one_message_per_frame(ws, BACKLOG) == list(range(BACKLOG))
        rounds = metric(gw, "fanout_rounds_total") - rounds_before
        writes = metric(gw, "fanout_staged_writes_total") - writes_before
    if cycles == 1:  # every cycle is a round, and each client's batch of it one write
        assert rounds >= BACKLOG and writes >= 3 * BACKLOG
    else:  # 200 cycles in rounds of 8: 25 rounds, one write per client per round
        assert rounds <= BACKLOG / cycles + 3, rounds
        assert writes <= 3 * (BACKLOG / cycles + 3), writes


def test_a_cold_message_is_not_held_back_by_a_rounds_backlog():
    """The cold topic's message goes in the next cycle, so in the round's write: before the hot backlog's
    next round, whatever the backlog (the default config's fairness, through rounds)."""
    with run_gateway(topics=RULES) as gw, ws_connect(gw) as ws:
        for topic in ("hot", "cold"):
            send(ws, op="subscribe", topic=topic)
            recv_entries(ws)
        publish = gw.hub.catalog.publish_nowait
        gw.call(lambda: ([publish("hot", i) for i in range(BACKLOG)], publish("cold", "now")))
        got = collect(ws, lambda g: any(e["topic"] == "cold" for e in g))
        hot_before = [e for e in got if e["topic"] == "hot"]
        assert len(hot_before) <= 1  # the cold one rides in the first cycle, beside the first hot message
        rest = collect(ws, lambda g: len(g) >= BACKLOG - len(hot_before))
        assert [e["seq"] for e in hot_before + rest] == list(range(BACKLOG))


def test_a_client_blocked_by_a_rounds_write_delays_nobody_and_catches_up_when_it_reads():
    big = {"rules": [{"pattern": "*", "anonymous": True, "capacity": 4096}]}
    payload = "x" * 2000
    high_water = 65536
    with (
        run_gateway(topics=big, websocket={"blocked_timeout_s": 30, "write_high_water": high_water}) as gw,
        ws_connect(gw, rcvbuf=4096, max_queue=1) as slow,
        ws_connect(gw) as fast,
    ):  # slow stops reading
        for ws in (slow, fast):
            send(ws, op="subscribe", topic="feed")
            assert recv_entries(ws)[0]["type"] == "subscribed"
        gw.call(lambda: [gw.hub.catalog.publish_nowait("feed", payload) for _ in range(1000)])
        got = collect(fast, lambda g: len(g) >= 1000, timeout=20)
        assert [e["seq"] for e in got] == list(range(1000))
        blocked = wait_for(lambda: gw.call(lambda: list(gw.hub.scheduler.blocked.values())), "the slow client blocked")
        # not ready once blocked: what waits in its transport is at most the high-water mark and one round
        buffered = gw.call(lambda: blocked[0].proto.transport.get_write_buffer_size())
        assert buffered <= high_water + 8 * (len(payload) + 100), buffered
        # reading again, the slow client gets every message in order (the ring holds them all)
        seqs = [e["seq"] for e in collect(slow, lambda g: len(g) >= 1000, timeout=20)]
        assert seqs == list(range(1000))
        wait_for(lambda: gw.call(lambda: not gw.hub.scheduler.blocked), "the slow client drained")


@pytest.mark.parametrize("cold_backlog", [1, 5])
def test_a_caught_up_client_is_written_after_its_cycle_not_held_for_anothers_backlog(cold_backlog):
    """A round goes on while some client has a backlog; a client with nothing more to come is written at the
    end of its cycle, so another's backlog never delays it: at once with one message, and with five (four
    cycles staged in the round, then caught up) after the fifth cycle."""
    rules = {"rules": [{"pattern": "*", "anonymous": True, "capacity": 32768}]}
    settings = {"write_coalesce_cycles": 100_000, "write_coalesce_ms": 60_000}  # the backlog is one round
    with (
        run_gateway(topics=rules, scheduler=settings, websocket={"write_high_water": 1 << 22}) as gw,
        ws_connect(gw) as backlogged,
        ws_connect(gw) as caught_up,
    ):
        send(backlogged, op="subscribe", topic="hot")
        send(caught_up, op="subscribe", topic="cold")
        for ws in (backlogged, caught_up):
            assert recv_entries(ws)[0]["type"] == "subscribed"
        gw.call(
            lambda: (
                [gw.hub.catalog.publish_nowait("hot", i) for i in range(20_000)],
                [gw.hub.catalog.publish_nowait("cold", i) for i in range(cold_backlog)],
            )
        )
        got = collect(caught_up, lambda g: len(g) >= cold_backlog)
        assert [e["data"] for e in got] == list(range(cold_backlog))
        with pytest.raises(TimeoutError):  # the backlog's round (20,000 cycles) still runs: nothing written yet
            backlogged.recv(timeout=0.05)
        got = collect(backlogged, lambda g: len(g) >= 20_000, timeout=30)
        assert [e["seq"] for e in got] == list(range(20_000))


def test_a_kick_mid_round_writes_the_rounds_frames_before_its_close():
    rules = {"rules": [{"pattern": "*", "anonymous": True, "capacity": 32768}]}
    settings = {"write_coalesce_cycles": 100_000, "write_coalesce_ms": 60_000}  # the backlog is one round
    with run_gateway(topics=rules, scheduler=settings, websocket={"write_high_water": 1 << 22}) as gw, ws_connect(gw) as ws:
        send(ws, op="subscribe", topic="hot")
        assert recv_entries(ws)[0]["type"] == "subscribed"
        (client_id,) = gw.call(lambda: list(gw.hub.clients.conns))
        publish_backlog(gw, "hot", 20_000)
        # the next loop turn is a yield between two cycles of the round: some frames are staged, none written
        assert gw.call(lambda: gw.hub.clients.kick(client_id, close_codes.KICKED, "kicked", "kicked"))
        seqs = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                seqs += [e["seq"] for e in recv_entries(ws)]
        assert closed.value.rcvd.code == close_codes.KICKED
        assert seqs and seqs == list(range(len(seqs)))  # what the round had staged, in order, then the close


def test_the_delivery_log_stamps_a_staged_batch_when_the_round_writes_it(tmp_path):
    settings = {"write_coalesce_cycles": 100_000, "write_coalesce_ms": 60_000}  # the backlog is one round
    log_settings = {"enabled": True, "directory": str(tmp_path), "sample_rate": 1.0, "flush_interval_s": 0.1}
    with (
        run_gateway(topics=RULES, scheduler=settings, deliverylog=log_settings, websocket={"write_high_water": 1 << 22}) as gw,
        ws_connect(gw) as ws,
    ):
        send(ws, op="subscribe", topic="feed")
        assert recv_entries(ws)[0]["type"] == "subscribed"
        publish_backlog(gw, "feed", 1000)
        assert len(collect(ws, lambda g: len(g) >= 1000)) == 1000
        hub = gw.hub
    hub.delivery_log._thread.join(10)  # the writer completes its last file once the hub stopped
    rows = [json.loads(line) for path in tmp_path.glob("deliveries-*.jsonl") for line in path.read_text().splitlines()]
    assert sorted(row["seq"] for row in rows) == list(range(1000))  # 1,000 batches of one message each
    assert len({row["deliver_ns"] for row in rows}) == 1  # one round, one write, one stamp
    assert all(row["deliver_ns"] >= row["publish_ns"] for row in rows)
