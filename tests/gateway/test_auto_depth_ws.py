"""`batch_depth = "auto"` through a real gateway: a WebSocket client behind by a burst gets it back in few
frames of several messages, without loss, and one message per frame once caught up; the setting is parsed,
refused when bad, and shown by the admin API."""

from __future__ import annotations

import pytest

from core.config import AUTO_MAX_SLICE
from gateway.config import ConfigError
from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, auth, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)

BURST = 1000
#: the ring holds the whole burst, so nothing can be lost whatever the interleaving of ingest and cycles
RULES = {
    "rules": [
        {"pattern": "hot.*", "kind": "ring", "capacity": 1024, "batch_depth": "auto", "anonymous": True},
        {"pattern": "*", "kind": "ring", "capacity": 1024, "batch_depth": 1, "anonymous": True},
    ]
}


def msgs(entries: list[dict]) -> list[int]:
    return [e["seq"] for e in entries if e["type"] == "msg"]


def test_a_burst_comes_back_in_few_frames_without_loss_then_one_message_per_frame():
    with run_gateway(topics=RULES) as gw, ws_connect(gw) as ws:
        send(ws, op="subscribe", topic="hot.feed", id=1)
        assert recv_entries(ws)[0]["type"] == "subscribed"
        pub = Ingest(gw)
        # One write of the whole burst: the ingest publishes it in one or a few turns, faster than one
        # message per cycle, so the subscriber is behind by up to the whole burst.
        pub.send(*({"topic": "hot.feed", "data": i} for i in range(BURST)))
        assert pub.sync()["accepted"] == BURST
        frames: list[list[dict]] = []
        seen: list[int] = []
        while len(seen) < BURST:
            frame = recv_entries(ws)
            assert [e["type"] for e in frame] == ["msg"] * len(frame), "no loss notice while the client reads"
            frames.append(frame)
            seen += msgs(frame)
        assert seen == list(range(BURST))
        # Depth 1 would take BURST cycles (one frame each); auto slices up to AUTO_MAX_SLICE while behind.
        # 150 leaves room for the ingest's publishing being spread over several turns with cycles between.
        assert len(frames) <= 150, len(frames)
        assert max(len(f) for f in frames) > 1
        assert max(len(f) for f in frames) <= AUTO_MAX_SLICE
        # Caught up: one message, one frame.
        for i in range(BURST, BURST + 5):
            pub.send({"topic": "hot.feed", "data": i})
            pub.sync()
            assert msgs(recv_entries(ws)) == [i]


def test_the_admin_api_creates_shows_and_refuses_auto():
    with run_gateway(topics=RULES) as gw, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        r = http.post("/api/topics", json={"name": "t.auto", "batch_depth": "auto"})
        assert r.status_code == 201 and r.json()["batch_depth"] == "auto", r.text
        assert http.get("/api/topics/t.auto").json()["batch_depth"] == "auto"
        # a name matching the auto rule gets it on first use, and shows it
        with ws_connect(gw) as ws:
            send(ws, op="subscribe", topic="hot.x")
            recv_entries(ws)
        assert http.get("/api/topics/hot.x").json()["batch_depth"] == "auto"
        assert http.post("/api/topics", json={"name": "t.four", "batch_depth": 4}).json()["batch_depth"] == 4
        for bad in (
            {"batch_depth": "fast"},
            {"batch_depth": 0},
            {"batch_depth": True},
            {"batch_depth": "auto", "kind": "private"},
            {"batch_depth": "auto", "kind": "snapshot"},
        ):
            r = http.post("/api/topics", json={"name": "t.bad", **bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", (bad, r.text)
            assert http.get("/api/topics/t.bad").status_code == 404
        r = http.post("/api/topics", json={"name": "t.bad", "batch_depth": "auto", "kind": "private"})
        assert 'batch_depth "auto" is for ring topics' in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"batch_depth": "fast"}, "batch_depth must be an integer in [1, 1024] or \"auto\", not 'fast'"),
        ({"batch_depth": "auto", "kind": "private"}, 'batch_depth "auto" is for ring topics, not private'),
    ],
)
def test_a_bad_rule_stops_the_gateway_with_a_clear_error(rule, message):
    with pytest.raises(ConfigError) as err, run_gateway(topics={"rules": [{"pattern": "x.*", **rule}]}):
        pass
    assert "topics.rules[0] (pattern 'x.*')" in str(err.value) and message in str(err.value)
