"""SSE transport against a real gateway on 127.0.0.1 (docs/protocol.md `## SSE`), read with a raw-socket client."""

import re
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.exceptions import InvalidStatus

from core import Engine, TopicConfig, TopicKind
from gateway import close_codes
from gateway.config import SseConfig
from gateway.errors import BadRequest
from gateway.testing import make_token, run_gateway
from gateway.transports.sse import DELETED, Positions, parse_positions
from tests import web
from tests.gateway.gw_helpers import Ingest, auth, wait_for, ws_connect
from tests.gateway.sse_client import SseClient, msgs

pytestmark = pytest.mark.timeout(60)

RING = {
    "rules": [{"pattern": "private.*", "kind": "private"}, {"pattern": "*", "anonymous": True, "capacity": 64, "batch_depth": 4}]
}


@pytest.fixture(scope="module")
def plain_gw():
    """A gateway of the defaults for tests that only read their own stream."""
    with run_gateway() as gw:
        yield gw


@pytest.fixture(scope="module")
def refusing_gw():
    """A gateway of the defaults that only the refusals at connect use: it never holds a client."""
    with run_gateway() as gw:
        yield gw


def positions(event_id: str) -> dict[str, tuple[str, int]]:
    return parse_positions(event_id, 1000)


def seqs(entries, topic):
    return [e["seq"] for e in msgs(entries, topic)]


def test_topics_at_connect_then_batches_in_order_with_their_positions():
    token = make_token("alice")
    with run_gateway(topics=RING) as gw, SseClient(gw, f"?topics=t.a,t.b,private.inbox&token={token}") as sse:
        assert sse.status == 200
        assert sse.headers["content-type"] == "text/event-stream"
        assert sse.headers["cache-control"] == "no-store"
        assert sse.headers["x-accel-buffering"] == "no"
        assert sse.headers["transfer-encoding"] == "chunked"
        session = sse.session()
        assert re.fullmatch(r"sse-[0-9a-f]{16}", session["client_id"])
        assert len(session["session"]) >= 22  # 128 bits, url-safe base64
        event = sse.next_event()
        first = event.json()
        assert [(e["type"], e["topic"]) for e in first] == [
            ("subscribed", "t.a"),
            ("subscribed", "t.b"),
            ("subscribed", "private.inbox"),
        ]
        epochs = {e["topic"]: e["epoch"] for e in first}
        # private topics are recovered by ownership, not by position
        assert positions(event.id) == {"t.a": (epochs["t.a"], 0), "t.b": (epochs["t.b"], 0)}
        pub = Ingest(gw)
        pub.send(*({"topic": "t.a", "data": i} for i in range(10)), {"topic": "t.b", "data": "b"})
        pub.sync()
        got, ids = [], []
        while seqs(got, "t.a") != list(range(10)) or not seqs(got, "t.b"):
            event = sse.next_event()
            assert event.data is not None and event.id is not None  # every batch here moves a position
            got += event.json()
            ids.append(positions(event.id))
        assert seqs(got, "t.b") == [0]
        assert ids[-1] == {"t.a": (epochs["t.a"], 10), "t.b": (epochs["t.b"], 1)}
        clients = web.get(f"{gw.http_url}/api/clients", headers=auth(gw)).json()["clients"]
        mine = next(c for c in clients if c["id"] == session["client_id"])
        assert mine["transport"] == "sse" and mine["user"] == "alice" and len(mine["subscriptions"]) == 3
        assert 'fanout_clients{transport="sse"} 1.0' in web.get(f"{gw.http_url}/metrics").text


def test_commands_by_post_are_answered_on_the_stream():
    with run_gateway() as gw, SseClient(gw, "?topics=chat.a") as sse, web.Client(base_url=gw.http_url) as http:
        secret = sse.session()["session"]
        event = sse.next_event()
        epoch = event.json()[0]["epoch"]
        commands = [{"op": "ping", "id": 1}, {"op": "publish", "topic": "chat.a", "data": "hi", "id": 2}]
        r = http.post(f"/sse/{secret}", json=commands)
        assert r.status_code == 202 and r.json() == {"accepted": 2}
        got = sse.collect(lambda g: msgs(g) and len(g) >= 3)
        assert {"type": "reply", "id": 1, "result": "pong"} in got
        assert {"type": "reply", "id": 2, "result": {"seq": 0}} in got
        assert msgs(got) == [{"type": "msg", "topic": "chat.a", "seq": 0, "data": "hi"}]
        assert positions(sse.last_event_id) == {"chat.a": (epoch, 1)}
        # a batch that moves no position carries no id
        assert http.post(f"/sse/{secret}", json={"op": "ping", "id": 3}).status_code == 202
        event = sse.next_event()
        assert event.json() == [{"type": "reply", "id": 3, "result": "pong"}] and event.id is None
        # an unsubscribe takes the topic out of the positions (an empty id: nothing to recover)
        http.post(f"/sse/{secret}", json={"op": "unsubscribe", "topic": "chat.a", "id": 4})
        event = sse.next_event()
        assert event.json() == [{"type": "unsubscribed", "topic": "chat.a", "id": 4}] and event.id == ""
        # bad bodies: as on long-poll
        r = http.post(f"/sse/{secret}", content=b"{nope")
        assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_json")
        r = http.post(f"/sse/{secret}", content=b"x" * 70000)
        assert (r.status_code, r.json()["error"]["code"]) == (413, "too_large")
        r = http.post(f"/sse/{secret}", json={"op": "nope"})
        assert r.status_code == 202
        assert sse.next_batch()[0]["code"] == "bad_command"
        for method in ("POST", "DELETE"):
            r = http.request(method, "/sse/not-a-session", json={"op": "ping"})
            assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_session")
        # DELETE ends the session: close 1000, end of the response
        assert http.delete(f"/sse/{secret}").status_code == 204
        event = sse.next_event()
        assert event.event == "close" and event.json() == {"code": 1000, "reason": "session deleted"}
        assert sse.next_event() is None and sse.ended
        assert http.post(f"/sse/{secret}", json={"op": "ping"}).status_code == 404


def test_last_event_id_recovers_two_topics_exactly_after_a_reconnect():
    with run_gateway(topics=RING) as gw:
        pub = Ingest(gw)
        with SseClient(gw, "?topics=t.a,t.b") as first:
            first.session()
            first.next_batch()  # subscribed
            pub.send(*({"topic": t, "data": i} for i in range(30) for t in ("t.a", "t.b")))
            pub.sync()
            got = first.collect(lambda g: len(msgs(g)) >= 12)  # part of it: the stream is cut mid-way
            last_id = first.last_event_id
        assert positions(last_id)["t.a"][1] == len(seqs(got, "t.a")) < 30
        pub.send(*({"topic": t, "data": i} for i in range(30, 40) for t in ("t.a", "t.b")))
        pub.sync()
        # as a browser reconnects: same URL (its stale `since` loses to the header), Last-Event-ID set
        stale = ",".join(f"{epoch}:{topic}:0" for topic, (epoch, _) in positions(last_id).items())
        with SseClient(gw, f"?topics=t.a,t.b&since={stale}", headers={"Last-Event-ID": last_id}) as second:
            second.session()
            rest = second.collect(lambda g: seqs(g, "t.a")[-1:] == [39] and seqs(g, "t.b")[-1:] == [39])
        assert not [e for e in rest if e["type"] in ("loss", "error")]
        for topic in ("t.a", "t.b"):
            assert seqs(got, topic) + seqs(rest, topic) == list(range(40))  # gapless, no duplicate


def test_a_recovery_point_off_the_ring_gets_a_loss_and_topics_of_the_point_are_subscribed():
    rules = {"rules": [{"pattern": "*", "anonymous": True, "capacity": 8}]}
    with run_gateway(topics=rules) as gw:
        pub = Ingest(gw)
        with SseClient(gw, "?topics=t.a") as first:
            first.session()
            first.next_batch()
            pub.send(*({"topic": "t.a", "data": i} for i in range(3)))
            pub.sync()
            first.collect(lambda g: seqs(g, "t.a")[-1:] == [2])
            since = first.last_event_id
        pub.send(*({"topic": "t.a", "data": i} for i in range(3, 23)))
        pub.sync()
        # no topics= at all: the recovery point's topics are subscribed; `since` as a library passes it
        with SseClient(gw, f"?since={since}") as second:
            second.session()
            got = second.collect(lambda g: seqs(g, "t.a")[-1:] == [22])
        assert [e for e in got if e["type"] == "loss"] == [
            {"type": "loss", "topic": "t.a", "from": 3, "to": 15, "reason": "gone"}
        ]
        assert seqs(got, "t.a") == list(range(15, 23))


@pytest.mark.parametrize("point", ["garbage", "e:t.a:-1", "e:t.a:9007199254740992", ":t.a:1", "e::1", "e:t.a:1,e:t.a:2"])
def test_a_malformed_recovery_point_is_an_error_entry_and_the_topics_go_on(plain_gw, point):
    with SseClient(plain_gw, "?topics=chat.a", headers={"Last-Event-ID": point}) as sse:
        sse.session()
        got = sse.collect(lambda g: any(e["type"] == "subscribed" for e in g))
        assert got[0]["type"] == "error" and got[0]["code"] == "bad_request", got
        assert "recovery point" in got[0]["message"]
        assert got[1] == {"type": "subscribed", "topic": "chat.a", "kind": "ring", "epoch": got[1]["epoch"], "seq": 0, "id": None}


def test_refused_topics_get_error_entries_and_the_others_go_on():
    with run_gateway(scheduler={"max_subscriptions": 2}) as gw, SseClient(gw, "?topics=private.x,chat.a,,chat.b,chat.c") as sse:
        sse.session()
        got = sse.collect(lambda g: len(g) >= 3)
        # 4 names for 2 subscriptions: the last 2 are not tried; of the first 2, one is refused
        assert [(e["type"], e.get("code") or e.get("topic")) for e in got] == [
            ("error", "too_many_subscriptions"),
            ("error", "forbidden"),
            ("subscribed", "chat.a"),
        ]
        assert got[0]["message"].startswith("2 topics beyond scheduler.max_subscriptions (2)")


@pytest.mark.parametrize(
    "query,code",
    [
        ("?token=not.a.token", 4001),
        (f"?token={make_token('bob', ttl=-60)}", 4011),
        ("?id=me", 4006),
    ],
)
def test_refusals_at_connect_are_a_stream_of_one_close_event(refusing_gw, query, code):
    gw = refusing_gw
    with SseClient(gw, query + "&topics=chat.a") as sse:
        assert sse.status == 200 and sse.headers["content-type"] == "text/event-stream"
        event = sse.next_event()
        assert event.event == "close" and event.json()["code"] == code
        assert sse.next_event() is None
        assert gw.call(lambda: len(gw.hub.clients.conns)) == 0


def test_origin_session_limit_and_the_disabled_switches():
    config = {"sse": {"max_sessions_per_ip": 1}, "server": {"allowed_origins": ["https://app.example"]}}
    with run_gateway(**config) as gw:
        with SseClient(gw, "?topics=chat.a", headers={"Origin": "https://evil.example"}) as sse:
            assert sse.status == 403 and sse.json()["error"]["code"] == "forbidden_origin"
        with SseClient(gw, "?topics=chat.a", headers={"Origin": "https://app.example"}) as sse:
            assert sse.status == 200 and sse.headers["access-control-allow-origin"] == "https://app.example"
            sse.session()
            with SseClient(gw, "?topics=chat.a") as second:
                assert second.status == 429 and second.headers["retry-after"] == "5"
                assert second.json()["error"]["code"] == "too_many_sessions"
    off = {"sse": {"enabled": False}, "longpoll": {"enabled": False}, "websocket": {"enabled": False}}
    with run_gateway(**off) as gw, web.Client(base_url=gw.http_url) as http:
        for method, path in [
            ("GET", "/sse?topics=a"),
            ("POST", "/sse/x"),
            ("DELETE", "/sse/x"),
            ("POST", "/lp"),
            ("GET", "/lp/x"),
            ("POST", "/lp/x"),
            ("DELETE", "/lp/x"),
        ]:
            r = http.request(method, path)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found"), (method, path)
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(gw)
        assert refused.value.response.status_code == 403
        assert http.get("/healthz").status_code == 200


def test_a_heartbeat_comment_when_nothing_else_is_written():
    with run_gateway(sse={"heartbeat_s": 0.3}) as gw, SseClient(gw, "?topics=chat.a") as sse:
        sse.session()
        sse.next_batch()
        event = sse.next_event(timeout=3)
        assert event.comments == [": ping"] and event.data is None


def test_a_slow_consumer_is_cut_with_4008_and_another_stream_is_unharmed():
    config = {
        "websocket": {"write_high_water": 16384, "blocked_timeout_s": 1.0},
        "topics": {"rules": [{"pattern": "*", "anonymous": True, "capacity": 4096, "batch_depth": 8}]},
    }
    payload = "x" * 20000
    with (
        run_gateway(**config) as gw,
        SseClient(gw, "?topics=t", rcvbuf=4096, read_head=False) as slow,
        SseClient(gw, "?topics=t") as fast,
    ):
        fast.session()
        fast.next_batch()
        wait_for(lambda: gw.call(lambda: len(gw.hub.clients.conns)) == 2, what="both streams")
        received = []

        def read_fast():
            while len(received) < 600:
                received.extend(seqs(fast.next_batch(10), "t"))

        reader = threading.Thread(target=read_fast)
        reader.start()
        pub = Ingest(gw)
        for _ in range(6):
            pub.send(*({"topic": "t", "data": {"i": i, "pad": payload}} for i in range(100)))
            pub.sync()
        reader.join(20)
        assert received == list(range(600))  # the fast reader got everything, in order, unharmed

        def cut():
            stats = web.get(f"{gw.http_url}/api/stats", headers=auth(gw)).json()
            return stats["disconnects"].get("sse:slow_consumer")

        assert wait_for(cut, what="the slow consumer's cut") == 1
        # it reads at last (within the grace): what was buffered, then the close event, then the end
        slow.read_head()
        events = []
        while (event := slow.next_event(10)) is not None:
            events.append(event)
        assert events[0].event == "session" and events[-1].event == "close"
        assert events[-1].json() == {"code": 4008, "reason": "slow consumer"}
        assert slow.ended
        assert gw.call(lambda: len(gw.hub.clients.conns)) == 1
        metrics = web.get(f"{gw.http_url}/metrics").text
        assert 'fanout_disconnects_total{reason="slow_consumer",transport="sse"} 1.0' in metrics


def test_a_shutdown_ends_the_stream_with_1001():
    events = []
    with run_gateway() as gw:
        sse = SseClient(gw, "?topics=chat.a")
        sse.session()
        sse.next_batch()

        def read():
            while (event := sse.next_event(20)) is not None:
                events.append(event)
            sse.close()  # as a browser does at the end of the response

        reader = threading.Thread(target=read)
        reader.start()
    reader.join(20)
    assert [(e.event, e.json()) for e in events] == [("close", {"code": 1001, "reason": "server shutting down"})]


def test_the_client_is_gone_from_the_hub_when_its_connection_closes_or_it_is_kicked():
    with run_gateway() as gw:
        with SseClient(gw, "?topics=chat.a") as sse:
            cid = sse.session()["client_id"]
            assert gw.call(lambda: cid in gw.hub.clients.conns and gw.hub.scheduler.engine.has_client(cid))
        wait_for(
            lambda: gw.call(lambda: cid not in gw.hub.clients.conns and not gw.hub.scheduler.engine.has_client(cid)),
            what="the client's removal",
        )
        wait_for(lambda: gw.call(lambda: not gw.running.server.server_state.connections), what="the connection's end")
        assert gw.call(lambda: gw.hub.clients.by_transport["sse"]) == 0
        with SseClient(gw, "?topics=chat.a") as sse:
            cid = sse.session()["client_id"]
            r = httpx.delete(f"{gw.http_url}/api/clients/{cid}", headers=auth(gw))
            assert r.status_code == 200
            event = sse.next_event()
            while event.event != "close":
                event = sse.next_event()
            assert event.json() == {"code": 4000, "reason": "kicked by admin"}
            assert sse.next_event() is None
        assert gw.call(lambda: cid not in gw.hub.clients.conns and not gw.hub.scheduler.engine.has_client(cid))


# -- a browser's EventSource ---------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium")
# as tests/e2e/test_static_page.py: without the background-networking flags Chromium keeps dialling out
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# The page publishes "one" through its stream's session, deletes the session when "one" arrives (close 1000),
# publishes "mid" through a long-poll session while the EventSource is away, and logs what the EventSource
# gets after its automatic reconnect (Last-Event-ID): "mid" only comes if the position was recovered.
PAGE = """<!doctype html><html><body><div id="log"></div><script>
const log = [];
const show = () => { document.getElementById('log').textContent = JSON.stringify(log); };
const post = (url, body) => fetch(url, {method: 'POST', body: JSON.stringify(body)});
let sessions = 0, secret = null, lp = null;
fetch('/lp', {method: 'POST'}).then(r => r.json()).then(s => { lp = s.session; start(); });
function start() {
  const es = new EventSource('/sse?topics=chat.e2e');
  es.addEventListener('session', e => {
    secret = JSON.parse(e.data).session; sessions += 1; log.push(['session', sessions]); show();
    if (sessions === 1) post('/sse/' + secret, {op: 'publish', topic: 'chat.e2e', data: 'one'});
  });
  es.onmessage = e => {
    for (const entry of JSON.parse(e.data)) {
      log.push([entry.type, entry.seq === undefined ? null : entry.seq, e.lastEventId]);
      if (entry.type === 'msg' && entry.data === 'one') fetch('/sse/' + secret, {method: 'DELETE'});
      if (entry.type === 'msg' && entry.data === 'mid') { log.push(['done']); es.close(); }
    }
    show();
  };
  es.addEventListener('close', e => {
    log.push(['close', JSON.parse(e.data).code]); show();
    post('/lp/' + lp, {op: 'publish', topic: 'chat.e2e', data: 'mid'});
  });
}
</script></body></html>"""


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
@pytest.mark.timeout(90)
def test_a_browsers_eventsource_reconnects_with_last_event_id_and_misses_nothing(tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "index.html").write_text(PAGE)
    with run_gateway(server={"static_dir": str(tmp_path / "www")}) as gw:
        page = subprocess.run(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={tmp_path / 'profile'}",
                "--virtual-time-budget=10000",
                "--dump-dom",
                f"{gw.http_url}/",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        wait_for(lambda: gw.call(lambda: gw.hub.clients.by_transport["sse"]) == 0, what="the streams' end")
    found = re.search(r'<div id="log">(.*?)</div>', page.stdout, re.S)
    assert found, page.stdout[-2000:]
    log = [tuple(row) for row in orjson.loads(found.group(1).replace("&quot;", '"'))]
    epoch = log[1][2].split(":")[0]
    # the publish's reply comes before its message, in the same batch or the one before
    assert [row[:2] for row in log].count(("reply", None)) == 1
    assert [row for row in log if row[0] != "reply"] == [
        ("session", 1),
        ("subscribed", 0, f"{epoch}:chat.e2e:0"),
        ("msg", 0, f"{epoch}:chat.e2e:1"),
        ("close", DELETED),
        # reconnected with Last-Event-ID: "mid", published while it was away, is not missed
        ("session", 2),
        ("subscribed", 1, f"{epoch}:chat.e2e:2"),
        ("msg", 1, f"{epoch}:chat.e2e:2"),
        ("done",),
    ], log


# -- the documentation -------------------------------------------------------------------------------------


def test_the_sse_section_names_the_routes_the_config_keys_and_close_codes_that_exist():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## SSE") : doc.index("\n## ", doc.index("## SSE"))]
    routes = {
        re.match(r"`(\w+ /sse[^`?]*)", line.split("|")[1].strip()).group(1)
        for line in section.splitlines()
        if line.startswith("| `")
    }
    assert routes == {"GET /sse", "POST /sse/SID", "DELETE /sse/SID"}
    keys = set(re.findall(r"`sse\.(\w+)`", section))
    assert keys and keys <= set(SseConfig.__struct_fields__)
    codes = {int(code) for code in re.findall(r"\b(1\d{3}|4\d{3})\b", section)}
    assert codes <= {value for name, value in vars(close_codes).items() if name.isupper()} | {DELETED}


# -- positions, without a server --------------------------------------------------------------------------


def test_positions_are_the_cursors_of_ring_and_snapshot_subscriptions_only():
    engine = Engine()
    engine.create_topic("r")
    engine.create_topic("s", TopicConfig(kind=TopicKind.SNAPSHOT))
    engine.create_topic("p", TopicConfig(kind=TopicKind.PRIVATE))
    engine.create_topic("a,b")
    engine.connect("c")
    for name in ("r", "s", "p", "a,b"):
        engine.subscribe("c", name)
    positions = Positions(engine.client("c"))
    epoch = {t.name: t.epoch for t in engine.topics()}
    assert positions() == f"{epoch['r']}:r:0,{epoch['s']}:s:0".encode()
    engine.publish("r", 1)
    engine.publish("r", 2)
    engine.publish("s", 1)
    while engine.has_work:
        engine.run_cycle()
        engine.write_done("c")
    assert positions() == f"{epoch['r']}:r:2,{epoch['s']}:s:1".encode()
    # churn: the cache of prefixes stays within twice the subscriptions
    for i in range(100):
        engine.create_topic(f"t{i}")
        engine.subscribe("c", f"t{i}")
        positions()
        engine.unsubscribe("c", f"t{i}")
    positions()
    assert len(positions._prefixes) <= 2 * len(engine.client("c").subs) + 16
    engine.unsubscribe("c", "r")
    assert positions() == f"{epoch['s']}:s:1".encode()


# -- the recovery point's parser ---------------------------------------------------------------------------


@given(st.text(max_size=80) | st.lists(st.text(alphabet=":,0123456789ab-\n", max_size=12), max_size=6).map(",".join))
def test_any_recovery_point_is_parsed_or_refused_with_a_clear_error(text):
    try:
        parsed = parse_positions(text, 4)
    except BadRequest as exc:
        assert exc.code == "bad_request" and exc.message.startswith(("the recovery point", "position "))
        return
    assert len(parsed) <= 4
    for topic, (epoch, seq) in parsed.items():
        assert epoch and ":" not in epoch and topic and 0 <= seq < 2**53


epochs = st.text(st.characters(blacklist_characters=":,\n\r\0", blacklist_categories=["Cs"]), min_size=1, max_size=8)
topic_names = st.text(st.characters(blacklist_characters=",\n\r\0", blacklist_categories=["Cs"]), min_size=1, max_size=12)


@given(st.dictionaries(topic_names, st.tuples(epochs, st.integers(0, 2**53 - 1)), max_size=5))
def test_positions_written_as_an_id_are_read_back(points):
    text = ",".join(f"{epoch}:{topic}:{seq}" for topic, (epoch, seq) in points.items())
    assert parse_positions(text, 5) == points
