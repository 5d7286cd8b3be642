"""A topic's `linger`, end to end: caught-up WebSocket subscribers get what was published within it in one
frame when it ends (the gateway's timer wakes them: nothing else happens meanwhile), and the topic's
settings show it. A topic without linger beside it is not held."""

import time

import pytest

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)

LINGER = 0.3
RULES = {
    "rules": [
        {"pattern": "hot.*", "anonymous": True, "batch_depth": "auto", "linger": LINGER},
        {"pattern": "*", "anonymous": True},
    ]
}


def test_what_is_published_within_the_linger_arrives_in_one_frame_when_it_ends():
    with run_gateway(topics=RULES) as gw, ws_connect(gw) as ws:
        for topic in ("hot.a", "cold.b"):
            send(ws, op="subscribe", topic=topic)
            assert recv_entries(ws)[0]["type"] == "subscribed"
        published = time.monotonic()
        gw.call(lambda: [gw.hub.catalog.publish_nowait("hot.a", i) for i in range(3)])
        gw.call(lambda: gw.hub.catalog.publish_nowait("cold.b", "now"))  # no linger: not held behind hot.a's
        cold = recv_entries(ws)
        assert [(e["topic"], e["seq"]) for e in cold] == [("cold.b", 0)]
        assert time.monotonic() - published < LINGER
        gw.call(lambda: gw.hub.catalog.publish_nowait("hot.a", 3))  # within the same linger
        hot = recv_entries(ws)
        waited = time.monotonic() - published
        assert [(e["topic"], e["seq"]) for e in hot] == [("hot.a", i) for i in range(4)]
        assert waited >= LINGER - 0.02, waited  # held for the linger (the loop's timers tick in ms)


def test_linger_is_a_topic_setting_on_the_admin_api():
    with run_gateway(topics=RULES) as gw, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        r = http.post("/api/topics", json={"name": "px.1", "kind": "snapshot", "linger": 0.5})
        assert r.status_code == 201, r.text
        assert r.json()["linger"] == 0.5
        assert http.post("/api/topics", json={"name": "hot.x"}).json()["linger"] == LINGER


def test_the_shipped_example_rule_for_hot_feeds_is_valid():
    import tomllib
    from pathlib import Path

    from core import TopicConfig

    text = (Path(__file__).parents[2] / "config" / "default.toml").read_text()
    block = text[text.index('# pattern = "hot.*"') :].split("\n\n")[0]
    rule = tomllib.loads("\n".join(line.removeprefix("# ") for line in block.splitlines()))
    assert rule.pop("pattern") == "hot.*" and rule["batch_depth"] == "auto" and rule["linger"] > 0
    TopicConfig(**rule)


def test_a_short_linger_is_not_held_by_a_longer_one_that_began_first():
    rules = {
        "rules": [{"pattern": "slow.*", "anonymous": True, "linger": 5.0}, {"pattern": "hot.*", "anonymous": True, "linger": 0.1}]
    }
    with run_gateway(topics=rules) as gw, ws_connect(gw) as ws:
        for topic in ("slow.a", "hot.b"):
            send(ws, op="subscribe", topic=topic)
            assert recv_entries(ws)[0]["type"] == "subscribed"
        gw.call(lambda: gw.hub.catalog.publish_nowait("slow.a", 0))  # due in 5 s
        published = time.monotonic()
        gw.call(lambda: gw.hub.catalog.publish_nowait("hot.b", 0))  # due in 0.1 s: first
        assert [(e["topic"], e["seq"]) for e in recv_entries(ws, timeout=3.0)] == [("hot.b", 0)]
        assert time.monotonic() - published < 2.0
