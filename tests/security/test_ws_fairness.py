"""One WebSocket connection's burst of commands is handled in turns of the event loop, between the other
clients' requests, not ahead of them (issue 24: frames of 60 `auth` or 100 `rpc topics` from 8 connections
kept /healthz of another client at 64-84 ms p99). Black-box: a gateway process of its own, real sockets."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from loadtest.floodprobe import FloodGateway, healthz_ms
from tests.security.bytes_helpers import TEXT, RawWs, ws_frame

pytestmark = pytest.mark.timeout(90)

#: replies are bounded per client in entries and bytes (4009): raised here, so the burst is all handled
SECTIONS = {
    "ingest": {"enabled": False},
    "scheduler": {"direct_queue_max": 1000000, "direct_queue_max_bytes": 1073741824, "direct_total_max_bytes": 2147483648},
    "limits": {"bad_input_log_per_s": 0},
}


def test_a_burst_of_commands_leaves_the_loop_to_other_clients(tmp_path):
    gateway = FloodGateway(tmp_path, SECTIONS)
    port = gateway.http_port
    try:
        assert max(healthz_ms(port) for _ in range(5)) < 1000
        attacker = RawWs(port, rcvbuf=1 << 20)
        answered = [0]

        def drain() -> None:  # the attacker reads its answers: nothing but its commands costs the gateway
            attacker.sock.settimeout(30)
            try:
                while chunk := attacker.sock.recv(1 << 20):
                    answered[0] += len(chunk)
            except OSError:
                pass

        # 100 commands of an unknown op per frame (~1.1 KB): each is answered `bad_command` (~6 us), so a
        # read of 256 KB took ~150 ms of the loop at once, and /healthz waited behind it
        frame = ws_frame(TEXT, json.dumps([{"op": "x"}] * 100).encode())
        burst = frame * 3000
        reader = threading.Thread(target=drain, daemon=True)
        sender = threading.Thread(target=attacker.send, args=(burst, 60.0), daemon=True)
        reader.start()
        sender.start()
        delays = []
        last, still = -1, time.monotonic()
        while len(delays) < 60 and time.monotonic() - still < 0.5:  # until the answers stop coming
            delays.append(healthz_ms(port))
            time.sleep(0.02)
            if answered[0] != last:
                last, still = answered[0], time.monotonic()
        sender.join(60)
        assert len(delays) >= 10, f"the burst took too short a time to measure ({len(delays)} probes)"
        assert answered[0] > 0
        delays.sort()
        median, p90, worst = delays[len(delays) // 2], delays[len(delays) * 9 // 10], delays[-1]
        # before: median ~80 ms, worst ~150-300 ms; now each turn gives the connections ~2 ms together (a
        # quiet machine: median ~10, worst ~40). The bounds tell the two apart at half the old figures, with
        # room for a machine the other test workers share (median 21.8, worst 66 ms seen there). The 90th
        # percentile, not the worst: one probe alone once took 139 ms in CI (median 16.8) as the VM stalled
        print(
            "healthz under the burst: median %.1f ms, p90 %.1f ms, worst %.1f ms, %d probes" % (median, p90, worst, len(delays))
        )
        assert median < 40 and p90 < 120, (median, p90, delays)
        attacker.close()
    finally:
        gateway.stop()


def test_commands_left_for_a_later_turn_are_all_run_in_order():
    from gateway.testing import run_gateway
    from gateway.transports.ws import ws_counters

    with run_gateway(scheduler={"direct_queue_max": 100000, "direct_queue_max_bytes": 1 << 26}) as gw:
        client = RawWs(gw.http_port, rcvbuf=1 << 20)
        try:
            deferred = ws_counters.input_deferrals
            frames = [
                ws_frame(TEXT, json.dumps([{"op": "ping", "id": i * 100 + j} for j in range(100)]).encode()) for i in range(300)
            ]
            assert client.send(b"".join(frames))  # one write: handled over many turns
            ids: list[int] = []
            for _opcode, payload in client.frames(timeout=10):
                ids += [entry["id"] for entry in json.loads(payload) if entry["type"] == "reply"]
                if len(ids) >= 30000:
                    break
            assert ids == list(range(30000))
            assert ws_counters.input_deferrals > deferred  # the burst did not fit one turn
            metrics = urllib.request.urlopen(f"{gw.http_url}/metrics", timeout=5).read().decode()
            assert f"fanout_ws_input_deferrals_total {float(ws_counters.input_deferrals)}" in metrics
        finally:
            client.close()


def test_a_connection_closed_in_a_later_turn_still_ends_cleanly():
    # a protocol error (RSV1 set, no extension) at the end of a burst that takes several turns: once the
    # client, closed with 1002, ends its side, the gateway closes at once (it reads again to see that end),
    # not at the grace 2 s later with a reset
    from gateway.testing import run_gateway

    with run_gateway(scheduler={"direct_queue_max": 100000, "direct_queue_max_bytes": 1 << 26}) as gw:
        client = RawWs(gw.http_port, rcvbuf=1 << 20)
        try:
            frame = ws_frame(TEXT, json.dumps([{"op": "ping", "id": 1}] * 100).encode())
            bad = bytes((0xC1,)) + ws_frame(TEXT, b"{}")[1:]
            assert client.send(frame * 100 + bad)  # one read (~140 KB), handled over several turns
            replies, code = 0, None
            for opcode, payload in client.frames(timeout=10):
                if opcode == 0x8:
                    code = int.from_bytes(payload[:2], "big")
                    break
                replies += sum(1 for entry in json.loads(payload) if entry["type"] == "reply")
            assert code == 1002 and replies > 0  # (the replies still queued when it failed are not sent)
            client.sock.shutdown(socket.SHUT_WR)
            start = time.monotonic()

            def open_connections() -> float:  # this /metrics request's own connection included
                text = urllib.request.urlopen(f"{gw.http_url}/metrics", timeout=5).read().decode()
                return float(text.split("\nfanout_http_connections ")[1].split()[0])

            while open_connections() > 1 and time.monotonic() - start < 5:
                time.sleep(0.05)
            assert time.monotonic() - start < 1.0  # not the grace's cut (2 s)
        finally:
            client.close()
