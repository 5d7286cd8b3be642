"""The stats stream shows the whole cluster (docs/architecture.md, "The stats stream and the dashboard"): two
gateway processes on a real Redis; node A's `GET /api/stats/stream` lists node B's clients (with their node
and rate), every node's counts and the cluster's totals; a kick of one of B's clients asked of A takes it
out of A's stream; once nobody watches, B stops putting its summary into Redis. In headless Chromium, A's
dashboard shows both nodes and B's clients, and its kick button closes a client held by B."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import orjson
import pytest
import redis
from websockets.exceptions import ConnectionClosed

from tests.cluster.cluster_helpers import TOKEN, subscribe
from tests.e2e.browser_cdp import CHROMIUM, Chromium, guarded  # the e2e suite's browser driver

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
FAST = {"stats_interval_s": 0.3}


@pytest.fixture(scope="module")
def pair(module_nodes):
    """Nodes A and B for the two tests that need two nodes and no overrides of their own (each test's clients
    are closed by its end)."""
    return module_nodes.start("a", admin=FAST), module_nodes.start("b", admin=FAST)


def snapshots(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def first(stream: Iterator[dict], condition, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    for snap in stream:
        if condition(snap):
            return snap
        last = snap
        assert time.monotonic() < deadline, f"timed out; last cluster view: {last and last.get('cluster')}"
    raise AssertionError("the stream ended")


def drain(ws, stop: threading.Event, closes: dict | None = None) -> None:
    try:
        while not stop.is_set():
            try:
                ws.recv(timeout=0.2)
            except TimeoutError:
                pass
    except ConnectionClosed as exc:
        if closes is not None:
            closes[ws] = exc.rcvd.code if exc.rcvd else None


def test_node_a_streams_node_b_clients_and_kicks_one(pair, module_redis):
    a, b = pair
    stop = threading.Event()
    with a.ws() as on_a, b.ws() as b1, b.ws() as b2:
        for ws in (on_a, b1, b2):
            subscribe(ws, "ticks")
        readers = [threading.Thread(target=drain, args=(ws, stop), daemon=True) for ws in (on_a, b1, b2)]
        for reader in readers:
            reader.start()
        listed = httpx.get(f"{a.http_url}/api/clients", headers=ADMIN, timeout=10).json()["clients"]
        node_of = {c["id"]: c["node"] for c in listed}
        assert len(node_of) == 3 and len(set(node_of.values())) == 2
        per_node = Counter(node_of.values())
        a_node, b_node = min(per_node, key=per_node.__getitem__), max(per_node, key=per_node.__getitem__)
        b_ids = {i for i, n in node_of.items() if n == b_node}

        def publish() -> None:
            while not stop.wait(0.05):
                a.publish("ticks", {"t": time.time()})

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        try:
            with httpx.stream("GET", f"{a.http_url}/api/stats/stream", headers=ADMIN, timeout=30) as response:
                assert response.status_code == 200
                stream = snapshots(response)

                def sees_b(snap: dict) -> bool:
                    cluster = snap["cluster"]
                    rows = {c["id"]: c for c in cluster["clients"]}
                    return (
                        b_ids <= rows.keys()
                        and all(rows[i]["node"] == b_node and (rows[i]["rate"] or 0) > 0 for i in b_ids)
                        and all(n["listed"] is not None for n in cluster["nodes"])
                    )

                snap = first(stream, sees_b)
                assert snap["node"] == a_node
                assert [c["id"] for c in snap["clients"]] == [i for i, n in node_of.items() if n == a_node]
                cluster = snap["cluster"]
                assert cluster["error"] is None
                assert cluster["totals"]["nodes"] == 2 and cluster["totals"]["clients"] == 3
                assert sum(cluster["totals"]["clients_by_transport"].values()) == 3
                assert {n["node"]: n["clients"] for n in cluster["nodes"]} == {a_node: 1, b_node: 2}
                assert len(cluster["clients"]) == 3 and cluster["others"]["clients"] == 0
                assert cluster["fairness"]["receiving"] == 3 and cluster["fairness"]["clients"] == 3
                assert 0 < cluster["fairness"]["jain"] <= 1 and cluster["fairness"]["share_min"] is not None
                assert cluster["totals"]["client_delivery_per_s"] > 0

                victim = sorted(b_ids)[0]
                kicked = httpx.delete(f"{a.http_url}/api/clients/{victim}", headers=ADMIN, timeout=10)
                assert kicked.json() == {"kicked": victim}  # held by B, asked of A
                snap = first(stream, lambda s: victim not in {c["id"] for c in s["cluster"]["clients"]})
                assert {n["node"]: n["clients"] for n in snap["cluster"]["nodes"]} == {a_node: 1, b_node: 1}
        finally:
            stop.set()
            publisher.join(5)
    # nobody watches now: the flag expires (at most 3 s) and B's next refresh drops its summary
    deadline = time.monotonic() + 10
    while True:
        raw = redis.Redis.from_url(module_redis.url).get(f"fanout:node:{b_node}")
        if raw is not None and "dash" not in orjson.loads(raw):
            break
        assert time.monotonic() < deadline, "B still writes its summary with nobody watching"
        time.sleep(0.2)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
@pytest.mark.timeout(120)
def test_node_a_dashboard_shows_node_b_and_kicks_its_client(pair, tmp_path):
    a, b = pair
    stop = threading.Event()
    closes: dict = {}
    with a.ws() as on_a, b.ws() as b1, b.ws() as b2:
        for ws in (on_a, b1, b2):
            subscribe(ws, "ticks")
        readers = [threading.Thread(target=drain, args=(ws, stop, closes), daemon=True) for ws in (on_a, b1, b2)]
        for reader in readers:
            reader.start()
        listed = httpx.get(f"{a.http_url}/api/clients", headers=ADMIN, timeout=10).json()["clients"]
        per_node = Counter(c["node"] for c in listed)
        b_node = max(per_node, key=per_node.__getitem__)
        b_ids = sorted(c["id"] for c in listed if c["node"] == b_node)

        def publish() -> None:
            while not stop.wait(0.1):
                a.publish("ticks", {"t": time.time()})

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        try:
            with Chromium(tmp_path / "profile", window=(1400, 1000)) as browser:
                browser.call("Page.navigate", url=f"{a.http_url}/admin/#token={TOKEN}")
                b_rows = f"document.querySelectorAll('#clients tr[data-node=\"{b_node}\"]')"
                browser.wait_for(
                    guarded(
                        "document.querySelectorAll('#nodes tbody tr').length === 2"
                        f" && {b_rows}.length === 2 && document.querySelectorAll('#clients tbody tr').length === 3"
                        " && !document.getElementById('nodes-panel').hidden"
                        " && document.getElementById('c-clients').textContent === '3'"
                    ),
                    30,
                    what="both nodes and B's two clients in A's dashboard",
                    dump="document.querySelector('main').innerText",
                )
                assert browser.evaluate(f"{b_rows}[0].querySelector('td.node-col').textContent") == b_node
                assert browser.evaluate("document.getElementById('c-transports').textContent").startswith("2 nodes")
                victim = b_ids[0]
                browser.evaluate(
                    f"window.confirm = () => true; document.querySelector('#clients tr[data-client=\"{victim}\"] button').click()"
                )
                browser.wait_for(
                    guarded(f"!document.querySelector('#clients tr[data-client=\"{victim}\"]') && {b_rows}.length === 1"),
                    what="the kicked client of B to leave A's table",
                )
                assert browser.errors == []
        finally:
            stop.set()
            publisher.join(5)
        for reader in readers:
            reader.join(5)
    assert sorted(closes.values()) == [4000]  # B's client, closed with the admin's code


def test_with_two_workers_one_stream_shows_both(nodes):
    """`server.workers = 2`: the kernel spreads the connections over both workers; whichever serves the
    stream lists every one of them."""
    w = nodes.start("w", server={"workers": 2}, admin=FAST)
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(w.ws()) for _ in range(16)]  # all on one worker: a 2**-15 chance
        for ws in clients:
            subscribe(ws, "ticks")
        listed = httpx.get(f"{w.http_url}/api/clients", headers=ADMIN, timeout=10).json()
        assert listed["total"] == 16 and listed["nodes"] == 2
        with httpx.stream("GET", f"{w.http_url}/api/stats/stream", headers=ADMIN, timeout=30) as response:
            snap = first(
                snapshots(response),
                lambda s: len(s["cluster"]["clients"]) == 16 and all(n["listed"] is not None for n in s["cluster"]["nodes"]),
            )
        cluster = snap["cluster"]
        assert cluster["totals"]["nodes"] == 2 and cluster["totals"]["clients"] == 16
        assert {c["id"] for c in cluster["clients"]} == {c["id"] for c in listed["clients"]}
        assert {c["node"] for c in cluster["clients"]} == {n["node"] for n in cluster["nodes"]}
