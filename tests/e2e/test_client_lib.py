"""static/fanout.js in a real browser (Debian's headless Chromium, driven over the DevTools protocol).

The gateway serves a site made of the library and tests/e2e/pages/harness.html, whose `start()` and `sub()`
connect with the library and record every event in `window.rec`. The tests publish through the admin API,
break the network or restart the gateway, and read what the page saw: seqs in order, no duplicate, and
every hole announced by exactly one `loss` event. Every wait polls with a generous deadline.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.config import SECTIONS
from gateway.testing import GatewayHandle, make_token, run_gateway
from loadtest.ports import free_port
from tests import web
from tests.e2e.browser_cdp import CHROMIUM, Chromium
from tests.e2e.browser_proxy import TcpProxy

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)"),
    pytest.mark.timeout(90),
]

ROOT = Path(__file__).resolve().parents[2]
DUMP = "JSON.stringify(rec)"
#: liveness quick enough for a test to see a dead connection, slow enough for a loaded machine
FAST = {"pingIntervalMs": 2000, "pingTimeoutMs": 4000, "backoffBaseMs": 200, "backoffMaxMs": 1000}
WS_SWITCH = "enabled" in SECTIONS["websocket"].__struct_fields__
SSE_SWITCH = "sse" in SECTIONS


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The static files the test gateways serve: the library as shipped, and the harness page."""
    root = tmp_path_factory.mktemp("site")
    shutil.copy(ROOT / "static" / "fanout.js", root / "fanout.js")
    shutil.copy(ROOT / "static" / "fossil.js", root / "fossil.js")  # fanout.js imports it
    shutil.copy(ROOT / "tests" / "e2e" / "pages" / "harness.html", root / "harness.html")
    return root


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    with Chromium(tmp_path_factory.mktemp("chromium")) as chromium:
        yield chromium


@pytest.fixture(scope="module")
def gw(site: Path) -> Iterator[GatewayHandle]:
    """One gateway for the tests that need no setting of their own: each has its own topics, page and proxy."""
    with gateway(site) as handle:
        yield handle


@contextmanager
def gateway(site: Path, **overrides: dict) -> Iterator[GatewayHandle]:
    server = {"static_dir": str(site), **overrides.pop("server", {})}
    with run_gateway(server=server, **overrides) as gw:
        yield gw


def publish(gw: GatewayHandle, topic: str, messages: list) -> list[int]:
    r = web.post(
        f"{gw.http_url}/api/topics/{topic}/publish",
        json={"messages": messages},
        headers={"Authorization": f"Bearer {gw.admin_token}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.json()["seqs"]


def start(browser: Chromium, base: str, topic: str, **options: object) -> None:
    browser.open(f"{base}/harness.html")
    browser.evaluate(f"start({json.dumps({**FAST, **options})})")
    browser.evaluate(f"sub({json.dumps(topic)})")
    browser.wait_for(f"rec.subscribed[{json.dumps(topic)}].length >= 1", what="subscribed", dump=DUMP)


def wait_msgs(browser: Chromium, topic: str, count: int, timeout: float = 30.0) -> list:
    browser.wait_for(f"rec.msgs[{json.dumps(topic)}].length >= {count}", timeout, what=f"{count} messages", dump=DUMP)
    return browser.evaluate(f"rec.msgs[{json.dumps(topic)}]")


def check_requests(browser: Chromium, transport: str, topic: str) -> None:
    """publish and rpc promises resolve over this transport; the gateway names it."""
    result = browser.evaluate(f"client.publish({json.dumps(topic)}, {{from: 'page'}})")
    assert isinstance(result["seq"], int)
    assert browser.evaluate("client.rpc('echo', {a: [1, 2]})") == {"a": [1, 2]}
    who = browser.evaluate("client.rpc('whoami')")
    assert who["transport"] == {"ws": "ws", "sse": "sse", "lp": "longpoll"}[transport]
    failed = browser.evaluate("client.rpc('nope').then(() => null, (e) => e.code)")
    assert failed == "unknown_method"
    seqs = [m[1] for m in wait_msgs(browser, topic, 1)]
    assert result["seq"] in seqs


@contextmanager
def _without_websocket(site: Path, **overrides: dict) -> Iterator[tuple[str, GatewayHandle]]:
    """A gateway whose WebSocket cannot be opened: `websocket.enabled = false` when the gateway has the
    switch, else a proxy in front of it that refuses the upgrade."""
    if WS_SWITCH:
        with gateway(site, websocket={"enabled": False}, **overrides) as gw:
            yield gw.http_url, gw
        return
    with gateway(site, **overrides) as gw, TcpProxy(gw.http_port) as proxy:
        proxy.refuse_websocket = True
        yield proxy.url, gw


def test_websocket_subscribes_receives_in_order_publishes_and_calls(gw: GatewayHandle, browser: Chromium) -> None:
    topic = "chat.lib"
    start(browser, gw.http_url, topic)
    assert browser.evaluate("client.transport") == "ws"
    publish(gw, topic, [{"n": i} for i in range(50)])
    msgs = wait_msgs(browser, topic, 50)
    assert [m[1] for m in msgs] == list(range(50))
    assert [m[2] for m in msgs] == [{"n": i} for i in range(50)]
    check_requests(browser, "ws", topic)
    rec = browser.evaluate("rec")
    assert rec["losses"][topic] == [] and rec["errors"] == []
    assert rec["states"] == ["connecting", "connected"]
    assert rec["transports"] == ["ws"]


def book(step: int) -> dict:
    """An order book of 40 levels a side; each step changes three levels."""
    levels = {"bids": [[10000 - i, 100 + i] for i in range(40)], "asks": [[10001 + i, 200 + i] for i in range(40)]}
    for k in range(3 * step):
        levels["bids" if k % 2 else "asks"][(k * 7) % 40][1] += 1
    return levels


def test_deltas_over_compressed_frames_arrive_intact(site: Path, browser: Chromium) -> None:
    """Chromium offers permessage-deflate by itself: the books arrive compressed, as fossil deltas, intact."""
    topic = "book.lib"
    rules = {"rules": [{"pattern": "book.*", "anonymous": True, "delta": "fossil"}]}
    with gateway(site, topics=rules) as gw:
        browser.open(f"{gw.http_url}/harness.html")
        browser.evaluate(f"start({json.dumps(FAST)})")
        browser.evaluate(f"sub({json.dumps(topic)}, {{delta: 'fossil'}})")
        browser.wait_for(f"rec.subscribed[{json.dumps(topic)}].length >= 1", what="subscribed", dump=DUMP)
        books = [book(step) for step in range(20)]
        for data in books:
            publish(gw, topic, [data])
        msgs = wait_msgs(browser, topic, 20)
        assert [m[2] for m in msgs] == books and [m[1] for m in msgs] == list(range(20))
        sub = f"subs[{json.dumps(topic)}]"
        assert browser.evaluate(f"{sub}.deltaGranted") is True
        assert browser.evaluate(f"{sub}.deltasApplied") == 19 and browser.evaluate(f"{sub}.deltaFailures") == 0
        metrics = web.get(f"{gw.http_url}/metrics", headers={"Authorization": f"Bearer {gw.admin_token}"}).text
        counts = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith(("fanout_ws_deflated_frames_total", "fanout_ws_deflate_"))
        }
        assert counts["fanout_ws_deflated_frames_total"] >= 1  # the first book, whole, went compressed
        assert counts["fanout_ws_deflate_output_bytes_total"] < counts["fanout_ws_deflate_input_bytes_total"] / 2


def test_a_new_gateway_on_the_same_port_is_one_epoch_loss(site: Path, browser: Chromium) -> None:
    topic = "feed.restart"
    port = free_port()
    with gateway(site, server={"port": port}) as gw:
        start(browser, gw.http_url, topic)
        publish(gw, topic, [{"n": i} for i in range(5)])
        first = wait_msgs(browser, topic, 5)
        old_epoch = first[0][0]
    browser.wait_for("client.state !== 'connected'", what="the page to see the gateway go", dump=DUMP)
    with gateway(site, server={"port": port}) as gw:
        browser.wait_for(f"rec.subscribed[{json.dumps(topic)}].length >= 2", what="resubscribed", dump=DUMP)
        publish(gw, topic, [{"n": i} for i in range(5, 10)])
        msgs = wait_msgs(browser, topic, 10)
        rec = browser.evaluate("rec")
    assert [m[1] for m in msgs] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert [m[2]["n"] for m in msgs] == list(range(10))
    new_epoch = msgs[5][0]
    assert new_epoch != old_epoch and all(m[0] == old_epoch for m in msgs[:5])
    assert rec["losses"][topic] == [{"topic": topic, "from": 5, "to": None, "reason": "epoch", "epoch": new_epoch}]
    assert browser.evaluate("client.reconnects") >= 1
    resumed = rec["subscribed"][topic][-1]
    assert resumed["resumed"] and resumed["epoch"] == new_epoch


def test_a_cut_network_recovers_gapless_and_without_duplicates(gw: GatewayHandle, browser: Chromium) -> None:
    topic = "feed.cut"
    with TcpProxy(gw.http_port) as proxy:
        start(browser, proxy.url, topic)
        publish(gw, topic, [{"n": i} for i in range(5)])
        wait_msgs(browser, topic, 5)
        proxy.refusing = True
        proxy.cut()
        browser.wait_for("client.state !== 'connected'", what="the page to see the cut", dump=DUMP)
        publish(gw, topic, [{"n": i} for i in range(5, 20)])  # while the page is away: replayed on return
        proxy.refusing = False
        msgs = wait_msgs(browser, topic, 20)
        publish(gw, topic, [{"n": 20}])
        msgs = wait_msgs(browser, topic, 21)
        rec = browser.evaluate("rec")
    assert [m[1] for m in msgs] == list(range(21))
    assert rec["losses"][topic] == []
    assert browser.evaluate("client.reconnects") >= 1
    assert rec["subscribed"][topic][-1]["resumed"]


def test_a_refused_websocket_falls_back_to_sse(site: Path, browser: Chromium) -> None:
    if not SSE_SWITCH:
        pytest.skip("the gateway has no SSE transport yet")
    topic = "chat.sse"
    with _without_websocket(site) as (url, gw):
        start(browser, url, topic)
        assert browser.evaluate("client.transport") == "sse"
        publish(gw, topic, [{"n": i} for i in range(30)])
        assert [m[1] for m in wait_msgs(browser, topic, 30)] == list(range(30))
        check_requests(browser, "sse", topic)
        rec = browser.evaluate("rec")
        assert rec["transports"] == ["sse"] and rec["losses"][topic] == []


def test_without_websocket_and_sse_long_poll_carries_the_same_events(site: Path, browser: Chromium) -> None:
    topic = "chat.lp"
    sse_off = {"sse": {"enabled": False}} if SSE_SWITCH else {}
    with _without_websocket(site, **sse_off) as (url, gw):
        start(browser, url, topic)
        assert browser.evaluate("client.transport") == "lp"
        publish(gw, topic, [{"n": i} for i in range(30)])
        assert [m[1] for m in wait_msgs(browser, topic, 30)] == list(range(30))
        check_requests(browser, "lp", topic)
        rec = browser.evaluate("rec")
        assert rec["transports"] == ["lp"] and rec["losses"][topic] == []


@pytest.mark.parametrize("transport", ["ws", "sse", "lp"])
def test_recovery_after_a_cut_on_each_transport(gw: GatewayHandle, browser: Chromium, transport: str) -> None:
    if transport == "sse" and not SSE_SWITCH:
        pytest.skip("the gateway has no SSE transport yet")
    topic = f"chat.cut-{transport}"
    with TcpProxy(gw.http_port) as proxy:
        start(browser, proxy.url, topic, transports=[transport])
        publish(gw, topic, [{"n": i} for i in range(3)])
        wait_msgs(browser, topic, 3)
        proxy.refusing = True
        proxy.cut()
        browser.wait_for("client.state !== 'connected'", what="the page to see the cut", dump=DUMP)
        publish(gw, topic, [{"n": i} for i in range(3, 10)])
        proxy.refusing = False
        msgs = wait_msgs(browser, topic, 10)
        assert browser.evaluate("client.transport") == transport
        check_requests(browser, transport, topic)
        rec = browser.evaluate("rec")
    assert [m[1] for m in msgs][:10] == list(range(10))
    assert rec["losses"][topic] == []


def test_an_expired_token_is_refreshed_on_the_connection(site: Path, browser: Chromium) -> None:
    topic = "chat.token"
    with gateway(site, auth={"leeway_s": 0, "expired_grace_s": 20}) as gw:
        browser.open(f"{gw.http_url}/harness.html")
        browser.evaluate(f"window.tokens = {json.dumps([make_token('alice', ttl=2), make_token('alice', ttl=600)])}")
        browser.evaluate(f"start({json.dumps(FAST)})")
        browser.evaluate(f"sub({json.dumps(topic)})")
        browser.wait_for("rec.events.some(([k]) => k === 'auth')", 30, what="the token to be refreshed", dump=DUMP)
        assert browser.evaluate("client.rpc('whoami')")["user"] == "alice"
        publish(gw, topic, [{"n": 1}])
        wait_msgs(browser, topic, 1)
        assert browser.evaluate("client.reconnects") == 0
        assert browser.evaluate("rec.errors") == []


def test_a_token_not_refreshed_in_time_is_closed_4011_and_the_client_reconnects(site: Path, browser: Chromium) -> None:
    topic = "chat.token4011"
    with gateway(site, auth={"leeway_s": 0, "expired_grace_s": 1}) as gw:
        browser.open(f"{gw.http_url}/harness.html")
        # the refresh gives another user's token (refused), so the gateway closes with 4011; then a good one (3 s:
        # the first token must still be valid when a loaded machine gets the long poll connected)
        tokens = [make_token("alice", ttl=3), make_token("bob"), make_token("alice")]
        browser.evaluate(f"window.tokens = {json.dumps(tokens)}")
        browser.evaluate(f"start({json.dumps({**FAST, 'transports': ['lp']})})")
        browser.evaluate(f"sub({json.dumps(topic)})")
        browser.wait_for("client.reconnects >= 1 && client.state === 'connected'", 30, what="the reconnect", dump=DUMP)
        assert browser.evaluate("client.rpc('whoami')")["user"] == "alice"
        publish(gw, topic, [{"n": 1}])
        wait_msgs(browser, topic, 1)
        rec = browser.evaluate("rec")
        closes = [e[1][1] for e in rec["events"] if e[0] == "state" and e[1][0] == "disconnected"]
        assert [c["code"] for c in closes] == [4011]
        assert [e[0] for e in rec["errors"]] == ["bad_token"]


@pytest.mark.parametrize("transport", ["ws", "sse", "lp"])
def test_a_bad_token_closes_the_client_without_reconnecting(gw: GatewayHandle, browser: Chromium, transport: str) -> None:
    browser.open(f"{gw.http_url}/harness.html")
    browser.evaluate(f"start({json.dumps({**FAST, 'token': 'not-a-jwt', 'transports': [transport]})})")
    browser.wait_for("client.state === 'closed'", what="the client to give up", dump=DUMP)
    rec = browser.evaluate("rec")
    assert rec["errors"][0][0] == "closed" and rec["errors"][0][2] == 4001
    # nothing more happens (not a timing assertion: a retry says "disconnected" at once, then connects again
    # within the backoff's first cap, 200-400 ms here)
    time.sleep(0.5)
    states = browser.evaluate("rec.states")  # a WebSocket opens, then gets 4001: "connected" in between
    assert states[-1] == "closed" and states.count("connecting") == 1 and "disconnected" not in states


def test_recovery_is_exact_on_synthetic_entries(gw: GatewayHandle, browser: Chromium) -> None:
    """The subscription's bookkeeping, fed entries directly: duplicates dropped, announced losses passed on,
    unannounced holes reported, snapshot jumps are conflation, a new epoch restarts the numbering."""
    browser.open(f"{gw.http_url}/harness.html")
    out = browser.evaluate("""(() => {
        const seen = [];
        const fake = Object.assign(new fanout.Client(location.origin, {transports: ["lp"]}), {});
        fake.close();
        const sub = new fanout.Subscription(fake, "t", null);
        sub.on("message", (m) => seen.push(["msg", m.epoch, m.seq]));
        sub.on("loss", (l) => seen.push(["loss", l.from, l.to, l.reason]));
        sub._onSubscribed({topic: "t", kind: "ring", epoch: "e1", seq: 3});
        for (const s of [3, 4, 4, 3, 5]) sub._onMsg({seq: s});
        sub._onLoss({from: 6, to: 9, reason: "lagged"});
        sub._onMsg({seq: 9}); sub._onMsg({seq: 12});
        sub.state = "subscribing";
        sub._onSubscribed({topic: "t", kind: "ring", epoch: "e1", seq: 11});   // reconnect: replay from 11
        sub._onMsg({seq: 11}); sub._onMsg({seq: 12}); sub._onMsg({seq: 13});
        sub.state = "subscribing";
        sub._onSubscribed({topic: "t", kind: "ring", epoch: "e2", seq: 0});    // another epoch
        sub._onLoss({from: 14, to: null, reason: "epoch"});
        sub._onMsg({seq: 0});
        const snap = new fanout.Subscription(fake, "s", null);
        snap.on("message", (m) => seen.push(["snap", m.seq]));
        snap.on("loss", (l) => seen.push(["snaploss"]));
        snap._onSubscribed({topic: "s", kind: "snapshot", epoch: "e1", seq: 7});
        snap._onMsg({seq: 7}); snap._onMsg({seq: 20}); snap._onMsg({seq: 19});
        const priv = new fanout.Subscription(fake, "p", null);
        priv.on("message", (m) => seen.push(["priv", m.seq]));
        priv._onSubscribed({topic: "p", kind: "private", epoch: "e1", seq: 0});
        priv._onMsg({seq: 0}); priv._onMsg({seq: 1}); priv._onMsg({seq: 2});
        priv.state = "subscribing";
        priv._onSubscribed({topic: "p", kind: "private", epoch: "e1", seq: 1});  // takeover: 1, 2 again
        priv._onMsg({seq: 1}); priv._onMsg({seq: 2}); priv._onMsg({seq: 3});
        priv.state = "subscribing";
        priv._onSubscribed({topic: "p", kind: "private", epoch: "e1", seq: 0});  // takeover: all of it again
        priv._onMsg({seq: 0}); priv._onMsg({seq: 4});
        priv.state = "subscribing";
        priv._onSubscribed({topic: "p", kind: "private", epoch: "e2", seq: 0});  // a new queue, new epoch
        priv._onMsg({seq: 0});
        return seen;
    })()""")
    assert out == [
        ["msg", "e1", 3],
        ["msg", "e1", 4],
        ["msg", "e1", 5],
        ["loss", 6, 9, "lagged"],
        ["msg", "e1", 9],
        ["loss", 10, 12, "gap"],
        ["msg", "e1", 12],
        ["msg", "e1", 13],
        ["loss", 14, None, "epoch"],
        ["msg", "e2", 0],
        ["snap", 7],
        ["snap", 20],
        ["priv", 0],
        ["priv", 1],
        ["priv", 2],
        ["priv", 3],
        ["priv", 4],
        ["priv", 0],
    ]


@pytest.mark.parametrize("transport", ["ws", "sse", "lp"])
def test_a_silent_connection_is_found_by_ping_and_replaced(gw: GatewayHandle, browser: Chromium, transport: str) -> None:
    topic = f"chat.silent-{transport}"
    # a ping every 1 s answered within 2 s (a loopback round trip: milliseconds), so the frozen connection is
    # found within 3 s; a reconnect made before the proxy passes again gives up after 2 s and tries again
    with TcpProxy(gw.http_port) as proxy:
        start(browser, proxy.url, topic, transports=[transport], connectTimeoutMs=2000, pingIntervalMs=1000, pingTimeoutMs=2000)
        publish(gw, topic, [{"n": 0}])
        wait_msgs(browser, topic, 1)
        no_pong = "rec.events.some(([k, v]) => k === 'state' && v[1].reason === 'no pong')"
        assert not browser.evaluate(no_pong)  # every ping answered while the path was open
        proxy.silent = True  # nothing passes and nothing closes: only the ping's missing reply tells
        proxy.freeze()
        publish(gw, topic, [{"n": i} for i in range(1, 5)])
        browser.wait_for(no_pong, 30, what="the ping timeout", dump=DUMP)
        proxy.silent = False
        browser.wait_for("client.reconnects >= 1 && client.state === 'connected'", 30, what="a new connection", dump=DUMP)
        msgs = wait_msgs(browser, topic, 5)
        check_requests(browser, transport, topic)
        rec = browser.evaluate("rec")
    assert [m[1] for m in msgs][:5] == list(range(5))
    assert rec["losses"][topic] == []


def test_the_transport_that_worked_is_kept_then_the_better_one_tried_again(gw: GatewayHandle, browser: Chromium) -> None:
    topic = "chat.sticky"
    with TcpProxy(gw.http_port) as proxy:
        proxy.refuse_websocket = True
        start(browser, proxy.url, topic, upgradeAfterMs=60000)
        assert browser.evaluate("client.transport") == "sse"
        assert proxy.websocket_refusals == 1
        proxy.cut()  # a reconnect uses SSE again: the WebSocket is not retried
        browser.wait_for("client.reconnects >= 1 && client.state === 'connected'", what="reconnect 1", dump=DUMP)
        assert browser.evaluate("client.transport") == "sse" and proxy.websocket_refusals == 1
        proxy.refuse_websocket = False
        browser.evaluate("client.options.upgradeAfterMs = 0")  # as if a long time had passed
        proxy.cut()  # now the next reconnect starts from the WebSocket again
        browser.wait_for("client.reconnects >= 2 && client.state === 'connected'", what="reconnect 2", dump=DUMP)
        assert browser.evaluate("client.transport") == "ws"
        publish(gw, topic, [{"n": 0}, {"n": 1}])
        msgs = wait_msgs(browser, topic, 2)
        assert browser.evaluate("rec.transports") == ["sse", "sse", "ws"]
    assert [m[1] for m in msgs] == [0, 1]


@pytest.mark.parametrize("transport", ["ws", "sse"])
def test_private_messages_are_acknowledged_so_a_takeover_gets_none_again(
    gw: GatewayHandle, browser: Chromium, transport: str
) -> None:
    """The library subscribes private queues with `ack: true` and acknowledges what it handed to the page: the
    user's next connection takes the queue over at its head, nothing comes twice."""
    import orjson
    from websockets.sync.client import connect

    topic = f"private.ack-{transport}"
    token = make_token("carol")
    start(browser, gw.http_url, topic, transports=[transport], token=token)
    r = web.post(
        f"{gw.http_url}/api/topics/{topic}/publish",
        json={"messages": [0, 1, 2], "client": "carol"},
        headers={"Authorization": f"Bearer {gw.admin_token}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert [m[1] for m in wait_msgs(browser, topic, 3)] == [0, 1, 2]
    # the acks go at the end of the turn that handed the messages over; acknowledged, they leave the queue
    admin = {"Authorization": f"Bearer {gw.admin_token}"}
    browser.until(
        lambda: web.get(f"{gw.http_url}/api/topics/{topic}", headers=admin, timeout=10).json()["queued"] == 0,
        what="the page's acks",
    )
    with connect(f"ws://127.0.0.1:{gw.http_port}/ws?token={token}") as ws:
        ws.send(orjson.dumps({"op": "subscribe", "topic": topic, "ack": True, "id": 1}).decode())
        entries = orjson.loads(ws.recv(timeout=10))
        subscribed = next(e for e in entries if e["type"] == "subscribed")
        assert subscribed["seq"] == 3  # the queue's head: 0-2 were acknowledged
        assert not [e for e in entries if e["type"] == "msg"]
    assert browser.evaluate("rec.errors") == []
