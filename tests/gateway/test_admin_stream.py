"""GET /api/stats/stream: the live feed of the dashboard (/admin/). Real gateway, real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, wait_for, ws_connect

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.2


def snapshots(response: httpx.Response) -> Iterator[dict]:
    """The `data:` events of an SSE response, decoded."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def feed_state(gw) -> dict:
    """The feed's viewers and the loop's tasks that belong to the stream, read on the gateway's loop."""

    def read() -> dict:
        feed = gw.hub.stats
        stream_tasks = []
        for task in asyncio.all_tasks():
            names = {frame.f_code.co_qualname for frame in task.get_stack(limit=100)}
            if task.get_name().startswith("admin-stats") or any("SnapshotStream" in n for n in names):
                stream_tasks.append(task.get_name())
        return {
            "viewers": feed.viewers if feed else 0,
            "sampler": feed is not None and feed.task is not None,
            "tasks": stream_tasks,
        }

    return gw.call(read)


def test_the_stream_needs_the_admin_token_in_the_header():
    with run_gateway() as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        for headers, query in (({}, ""), ({"Authorization": "Bearer wrong"}, ""), ({}, f"?token={gw.admin_token}")):
            r = http.get(f"/api/stats/stream{query}", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
            assert r.headers["www-authenticate"] == "Bearer"
        spec = http.get("/api/openapi.json").json()
        assert "text/event-stream" in spec["paths"]["/api/stats/stream"]["get"]["responses"]["200"]["content"]
        assert feed_state(gw) == {"viewers": 0, "sampler": False, "tasks": []}


def test_snapshots_come_at_the_interval_with_rates_of_real_traffic():
    n = 25
    with (
        run_gateway(admin={"stats_interval_s": INTERVAL}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw) as ws,
    ):
        send(ws, op="subscribe", topic="t.rate")
        collect(ws, lambda got: any(e["type"] == "subscribed" for e in got))
        client_id = http.get("/api/clients").json()["clients"][0]["id"]
        with http.stream("GET", "/api/stats/stream") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = snapshots(r)
            first = next(events)
            assert first["dt"] is None and first["viewers"] == 1  # nothing to take a delta from yet
            [row] = [c for c in first["clients"] if c["id"] == client_id]
            assert row["transport"] == "ws" and row["subscription_count"] == 1 and row["state"] == "ready"
            before = row["entries_sent"]
            assert http.post("/api/topics/t.rate/publish", json={"messages": list(range(n))}).status_code == 200
            got = collect(ws, lambda g: sum(e["type"] == "msg" for e in g) == n)
            assert [e["data"] for e in got] == list(range(n))
            # the delivery count rises by exactly n, and the rates of the snapshots since add up to it
            client_moved = topic_moved = 0.0
            for snap in events:
                assert snap["dt"] >= INTERVAL * 0.9 and snap["interval_s"] == INTERVAL
                [row] = [c for c in snap["clients"] if c["id"] == client_id]
                [topic] = [t for t in snap["topics"] if t["name"] == "t.rate"]
                client_moved += row["rate"] * snap["dt"]
                topic_moved += topic["rate"] * snap["dt"]
                if row["entries_sent"] == before + n:
                    break
                assert row["entries_sent"] < before + n
            assert client_moved == pytest.approx(n, abs=0.5) and topic_moved == pytest.approx(n, abs=0.5)
            assert row["lag"] == 0 and row["write_blocked"] is False
            assert topic["kind"] == "ring" and topic["subscribers"] == 1 and topic["end"] == n
            assert snap["totals"]["clients"] == 1 and snap["totals"]["topics"] == 1
            assert snap["others"] == {"topics": 0, "clients": 0, "rate": 0.0}
            histograms = snap["histograms"]
            assert sum(histograms["entries_per_batch"]["counts"]) >= 1
            assert sum(histograms["cycle_seconds"]["counts"]) >= 1
            assert len(histograms["cycle_seconds"]["counts"]) == len(histograms["cycle_seconds"]["bounds"]) + 1
            assert snap["raw"] is None  # rawtcp disabled in test gateways
            assert snap["cluster"] is None and snap["node"] is None  # no broker: this process is the whole
            assert all("node" not in c for c in snap["clients"])


def test_the_snapshot_lists_the_busiest_and_sums_the_rest():
    from gateway import stats_feed

    with (
        run_gateway(admin={"stats_interval_s": INTERVAL}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
    ):
        top = stats_feed.STREAM_TOP
        http.post("/api/topics/t.busy/publish", json={"messages": [1, 2, 3]})
        for i in range(top + 5):
            http.post("/api/topics", json={"name": f"t.idle-{i:03d}"})
        with http.stream("GET", "/api/stats/stream") as r:
            events = snapshots(r)
            next(events)
            http.post("/api/topics/t.busy/publish", json={"messages": [4, 5]})
            snap = next(events)  # its delta covers the publish, made after the first snapshot
        assert len(snap["topics"]) == top and snap["others"]["topics"] == 6
        assert snap["topics"][0]["name"] == "t.busy" and snap["topics"][0]["rate"] > 0
        assert snap["totals"]["topics"] == top + 6


def test_raw_receivers_are_in_the_snapshot_when_rawtcp_is_enabled():
    with (
        run_gateway(rawtcp={"enabled": True}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        socket.create_connection(("127.0.0.1", gw.raw_receiver_port), timeout=5),
    ):
        wait_for(lambda: http.get("/api/raw/receivers").json()["receivers"], "the receiver")
        with http.stream("GET", "/api/stats/stream") as r:
            snap = next(snapshots(r))
    assert snap["raw"]["stats"]["sender_connected"] is False
    [receiver] = snap["raw"]["receivers"]
    assert receiver["lag"] == 0 and receiver["state"]


def test_viewers_beyond_the_bound_get_429_and_a_freed_slot_is_taken_again():
    with (
        run_gateway(admin={"stats_interval_s": INTERVAL, "stats_max_viewers": 2}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
    ):
        with http.stream("GET", "/api/stats/stream") as one, http.stream("GET", "/api/stats/stream") as two:
            # keep the readers: dropping a generator of iter_lines closes its response
            readers = [snapshots(one), snapshots(two)]
            assert [next(reader)["viewers"] for reader in readers] in ([1, 1], [1, 2])  # 2nd may get the 1st's
            assert feed_state(gw)["viewers"] == 2
            r = http.get("/api/stats/stream")
            assert r.status_code == 429 and r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "too_many_viewers"
            assert feed_state(gw)["viewers"] == 2
            assert any(next(readers[0])["viewers"] == 2 for _ in range(10))  # a sample taken since both joined
        wait_for(lambda: feed_state(gw)["viewers"] == 0, "the viewers to be counted out")
        with http.stream("GET", "/api/stats/stream") as three:
            assert three.status_code == 200 and next(snapshots(three))["viewers"] == 1


def test_the_stream_ends_when_the_viewer_disconnects():
    with run_gateway(admin={"stats_interval_s": 5.0}) as gw:  # long interval: the cut comes between samples
        request = (
            f"GET /api/stats/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {gw.admin_token}\r\n\r\n"
        ).encode()
        for _ in range(2):  # twice: the second viewer starts a fresh sampler
            with socket.create_connection(("127.0.0.1", gw.http_port), timeout=5) as sock:
                sock.sendall(request)
                received = b""
                while b"data: " not in received:
                    chunk = sock.recv(65536)
                    assert chunk, received
                    received += chunk
                assert received.startswith(b"HTTP/1.1 200")
                state = feed_state(gw)
                assert state["viewers"] == 1 and state["sampler"] and state["tasks"]
            # closed by the viewer: the stream, its disconnect watcher and the sampler are gone, well before
            # the next sample would have been due
            wait_for(
                lambda: feed_state(gw) == {"viewers": 0, "sampler": False, "tasks": []}, "the stream's tasks to end", timeout=4.0
            )


def test_a_shutdown_ends_the_stream_instead_of_waiting_for_it():
    ended = threading.Event()
    with run_gateway(admin={"stats_interval_s": INTERVAL}) as gw:
        http = web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10)

        def watch() -> None:
            with http.stream("GET", "/api/stats/stream") as r:
                for _ in snapshots(r):
                    pass
            ended.set()  # the response was completed by the server, not cut by the client

        viewer = threading.Thread(target=watch, daemon=True)
        viewer.start()
        wait_for(lambda: feed_state(gw)["viewers"] == 1, "the viewer")
        stopping = time.monotonic()
    # uvicorn would otherwise wait its graceful timeout (5 s) for the open stream, then cut it
    assert ended.wait(10) and time.monotonic() - stopping < 4.5
    http.close()


def test_fairness_is_the_share_index_one_while_all_keep_up_and_drops_when_one_stalls():
    """Clients of topics published at different rates (1, 3 and 8 messages per 20 ms), all reading: each
    got all it asked for, the index is 1.0 (the raw rates' index would be ~0.7). One client of the fast
    topic stops reading: once its kernel buffers are full, entries wait for it and the index drops to about
    3 caught up and 1 at 0: (1+1+1+0)^2 / (4 * 3) = 0.75. A client whose topic gets nothing is left out.
    Reading again, the staller catches up: 1.0 again."""
    config = {
        "admin": {"stats_interval_s": 0.25},
        "websocket": {"write_high_water": 16384, "blocked_timeout_s": 30},
        "topics": {"rules": [{"pattern": "*", "anonymous": True, "capacity": 16384}]},
    }
    per_tick = {"t.slow": 1, "t.mid": 3, "t.fast": 8}
    payload = "x" * 2000
    stop, stalled, published = threading.Event(), threading.Event(), threading.Event()

    def read(ws, may_stall: bool) -> None:
        while not stop.is_set():
            if may_stall and stalled.is_set():
                stop.wait(0.05)
                continue
            try:
                ws.recv(timeout=0.1)
            except TimeoutError:
                pass

    def publish(gw) -> None:
        router = gw.hub.catalog
        while not published.wait(0.02):
            gw.call(lambda: [router.publish_nowait(topic, payload) for topic, n in per_tick.items() for _ in range(n)])

    with (
        run_gateway(**config) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
        ws_connect(gw) as slow,
        ws_connect(gw) as mid,
        ws_connect(gw) as fast,
        ws_connect(gw) as idle,
        ws_connect(gw, rcvbuf=4096, max_queue=1) as staller,
    ):
        clients = [
            (slow, "t.slow", False),
            (mid, "t.mid", False),
            (fast, "t.fast", False),
            (idle, "t.idle", False),
            (staller, "t.fast", True),
        ]
        for ws, topic, _ in clients:
            send(ws, op="subscribe", topic=topic)
            assert collect(ws, lambda got: any(e["type"] == "subscribed" for e in got))
        threads = [threading.Thread(target=read, args=(ws, may_stall), daemon=True) for ws, _, may_stall in clients]
        threads.append(threading.Thread(target=publish, args=(gw,), daemon=True))
        for thread in threads:
            thread.start()
        try:
            with http.stream("GET", "/api/stats/stream") as r:
                events = snapshots(r)
                assert next(events)["fairness"]["jain"] is None  # no window yet
                keeping_up = [next(events)["fairness"] for _ in range(5)][1:]  # the first window: publisher starting
                for fairness in keeping_up:
                    assert fairness["clients"] == 4  # the idle client asked for nothing: left out
                    assert fairness["jain"] >= 0.99 and fairness["share_min"] >= 0.8, keeping_up
                    assert fairness["receiving"] == 4 and fairness["max"] > 5 * fairness["min"], keeping_up

                stalled.set()
                deadline = time.monotonic() + 8
                for snap in events:
                    fairness = snap["fairness"]
                    if fairness["jain"] <= 0.8:
                        break
                    assert time.monotonic() < deadline, f"the index did not drop: {fairness}"
                snap = next(events)  # a whole window stalled: the staller took nothing, the others all
                fairness = snap["fairness"]
                assert fairness["clients"] == 4 and fairness["jain"] <= 0.76 and fairness["share_min"] == 0, fairness
                stuck = max(snap["clients"], key=lambda c: c["lag"])
                assert stuck["rate"] == 0 and stuck["lag"] > 100 and stuck["write_blocked"], stuck

                stalled.clear()
                deadline = time.monotonic() + 8
                for snap in events:
                    if snap["fairness"]["jain"] >= 0.99 and max(c["lag"] for c in snap["clients"]) < 10:
                        break
                    assert time.monotonic() < deadline, f"no recovery: {snap['fairness']}"
        finally:
            stalled.clear()
            published.set()  # the staller drains all before its close handshake (a full queue would hold it)
            wait_for(
                lambda: gw.call(
                    lambda: not any(c.has_work() for c in gw.hub.scheduler.engine.clients()) and not gw.hub.scheduler.blocked
                ),
                "every client drained",
            )
            stop.set()
            for thread in threads:
                thread.join(5)
