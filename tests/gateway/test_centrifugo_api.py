"""The Centrifugo server API (docs/centrifugo.md, "Server API") with the real `cent` client, sync and async,
against a real gateway and real /ws subscribers: publish and broadcast with offset = seq + 1, history with
Centrifugo's limit / since / reverse, presence, info, channels, a user's connections subscribed, unsubscribed,
refreshed and disconnected, batch, auth, and bad input answered 107 with nothing disturbed."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest
import requests
from cent import (
    AsyncClient,
    BatchRequest,
    BroadcastRequest,
    ChannelsRequest,
    Client,
    DisconnectRequest,
    HistoryRequest,
    InfoRequest,
    PresenceRequest,
    PresenceStatsRequest,
    PublishRequest,
    RefreshRequest,
    SubscribeRequest,
    UnsubscribeRequest,
)
from cent.dto import Disconnect, StreamPosition
from cent.exceptions import CentApiResponseError, CentUnauthorizedError

from gateway.config import ConfigError
from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, wait_for, ws_connect
from tests.gateway.test_user_control import close_of

RULES = {
    "rules": [
        {"pattern": "hist.*", "kind": "ring", "capacity": 8, "anonymous": True},
        {"pattern": "big.*", "kind": "ring", "capacity": 10000, "anonymous": True},
        {"pattern": "room.*", "kind": "ring", "capacity": 64, "anonymous": True, "presence": True},
        {"pattern": "snap.*", "kind": "snapshot", "anonymous": True},
        {"pattern": "private.*", "kind": "private"},
        {"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True},
    ]
}

_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}.{next(_names)}"


@pytest.fixture(scope="module")
def gw():
    with run_gateway(topics=RULES) as gateway:
        yield gateway


def cent_client(gw, key: str | None = None, prefix: str = "/api") -> Client:
    session = requests.Session()
    session.trust_env = False  # no proxy between the test and loopback
    return Client(f"{gw.http_url}{prefix}", gw.admin_token if key is None else key, timeout=10, session=session)


@pytest.fixture
def cent(gw):
    with cent_client(gw) as client:
        yield client


def subscribed(ws, topic: str) -> dict:
    send(ws, op="subscribe", topic=topic, id=topic)
    got = collect(ws, lambda es: any(e.get("id") == topic for e in es))
    (entry,) = [e for e in got if e.get("id") == topic]
    assert entry["type"] == "subscribed", entry
    return entry


def messages(ws, topic: str | None, count: int) -> list[dict]:
    """The next `count` messages (of `topic`, or of any topic)."""

    def mine(entries: list[dict]) -> list[dict]:
        return [e for e in entries if e["type"] == "msg" and topic in (None, e["topic"])]

    return mine(collect(ws, lambda es: len(mine(es)) >= count))


def test_publish_and_broadcast_reach_ws_subscribers_with_offset_seq_plus_one(gw, cent):
    a, b = fresh("news"), fresh("news")
    with ws_connect(gw) as ws:
        epoch_a, epoch_b = subscribed(ws, a)["epoch"], subscribed(ws, b)["epoch"]
        result = cent.publish(PublishRequest(channel=a, data={"n": 1}))
        assert (result.offset, result.epoch) == (1, epoch_a)
        answer = cent.broadcast(BroadcastRequest(channels=[a, b], data={"n": 2}))
        assert [(r.error, r.result.offset, r.result.epoch) for r in answer.responses] == [(None, 2, epoch_a), (None, 1, epoch_b)]
        got = messages(ws, None, 3)
        assert [(m["seq"], m["data"]) for m in got if m["topic"] == a] == [(0, {"n": 1}), (1, {"n": 2})]
        assert [(m["seq"], m["data"]) for m in got if m["topic"] == b] == [(0, {"n": 2})]


def test_broadcast_answers_each_channel_and_one_refusal_stops_no_other(gw, cent):
    good = fresh("news")
    answer = cent.broadcast(BroadcastRequest(channels=[fresh("private"), good], data=1))
    first, second = answer.responses
    assert first.error is not None and first.error.code == 108 and "private" in first.error.message
    assert second.error is None and second.result.offset == 1


def test_a_retry_with_the_same_idempotency_key_publishes_once(gw, cent):
    topic = fresh("news")
    with ws_connect(gw) as ws:
        subscribed(ws, topic)
        first = cent.publish(PublishRequest(channel=topic, data="once", idempotency_key="k1"))
        retry = cent.publish(PublishRequest(channel=topic, data="once", idempotency_key="k1"))
        other = cent.publish(PublishRequest(channel=topic, data="twice", idempotency_key="k2"))
        assert (first.offset, retry.offset, other.offset) == (1, 1, 2) and retry.epoch == first.epoch
        assert [m["data"] for m in messages(ws, topic, 2)] == ["once", "twice"]
    history = cent.history(HistoryRequest(channel=topic, limit=-1))
    assert [p.data for p in history.publications] == ["once", "twice"]


def test_history_limit_since_and_reverse_as_centrifugo_means_them(gw, cent):
    topic = fresh("hist")
    epoch = ""
    for n in range(10):  # a ring of 8: offsets 3..10 retained
        epoch = cent.publish(PublishRequest(channel=topic, data=n)).epoch

    def offsets(**fields) -> list[int]:
        result = cent.history(HistoryRequest(channel=topic, **fields))
        assert (result.offset, result.epoch) == (10, epoch)
        assert all(p.data == p.offset - 1 for p in result.publications)
        return [p.offset for p in result.publications]

    assert offsets() == [] and offsets(limit=0) == []  # the stream position only
    assert offsets(limit=3) == [3, 4, 5]
    assert offsets(limit=-1) == list(range(3, 11))
    assert offsets(limit=3, reverse=True) == [10, 9, 8]
    assert offsets(limit=10, since=StreamPosition(offset=7, epoch=epoch)) == [8, 9, 10]
    assert offsets(limit=-1, since=StreamPosition(offset=10, epoch=epoch)) == []
    assert offsets(limit=2, since=StreamPosition(offset=7, epoch=epoch), reverse=True) == [6, 5]
    assert offsets(limit=2, since=StreamPosition(offset=8)) == [9, 10]  # no epoch: any
    for since in (StreamPosition(offset=1, epoch=epoch), StreamPosition(offset=8, epoch="another")):
        with pytest.raises(CentApiResponseError) as info:  # publications after it are gone / another stream
            cent.history(HistoryRequest(channel=topic, limit=5, since=since))
        assert info.value.code == 112


def test_history_of_a_snapshot_is_its_latest_value_and_unknown_names_are_empty(gw, cent):
    topic = fresh("snap")
    for n in range(3):
        cent.publish(PublishRequest(channel=topic, data={"v": n}))
    result = cent.history(HistoryRequest(channel=topic, limit=-1))
    assert result.offset == 3 and [(p.offset, p.data) for p in result.publications] == [(3, {"v": 2})]
    never = cent.history(HistoryRequest(channel=fresh("news"), limit=-1))
    assert (never.publications, never.offset) == ([], 0)


def test_presence_and_presence_stats_of_connected_clients(gw, cent):
    room = fresh("room")
    with ws_connect(gw, query=f"?token={make_token('alice')}") as alice, ws_connect(gw) as anonymous:
        subscribed(alice, room)
        subscribed(anonymous, room)
        alice_id = gw.client_of("alice")
        members = cent.presence(PresenceRequest(channel=room)).presence
        assert len(members) == 2 and members[alice_id].user == "alice" and members[alice_id].client == alice_id
        assert sorted(m.user for m in members.values()) == ["", "alice"]
        stats = cent.presence_stats(PresenceStatsRequest(channel=room))
        assert (stats.num_clients, stats.num_users) == (2, 2)
    with pytest.raises(CentApiResponseError) as info:  # a topic without presence
        cent.presence(PresenceRequest(channel=fresh("news")))
    assert info.value.code == 108


def test_info_and_channels(gw, cent):
    matching, other = fresh("chan"), fresh("news")
    with ws_connect(gw) as ws:
        subscribed(ws, matching)
        subscribed(ws, other)
        (node,) = cent.info(InfoRequest()).nodes
        assert node.uid and node.name and node.num_clients >= 1 and node.num_subs >= 2 and node.num_channels >= 2
        listed = cent.channels(ChannelsRequest(pattern="chan.*")).channels
        assert matching in listed and other not in listed and listed[matching].num_clients == 1
        everything = cent.channels(ChannelsRequest()).channels
        assert {matching, other} <= set(everything)


def test_disconnect_closes_the_users_connections_with_4005_one_or_all(gw, cent):
    with (
        ws_connect(gw, query=f"?token={make_token('carol')}") as first,
        ws_connect(gw, query=f"?token={make_token('carol')}") as second,
        ws_connect(gw, query=f"?token={make_token('dan')}") as other,
    ):
        wait_for(lambda: gw.call(lambda: len(gw.hub.clients.by_user.get("carol", ()))) == 2, "carol's connections")
        first_id, second_id = gw.call(lambda: list(gw.hub.clients.by_user["carol"]))
        cent.disconnect(DisconnectRequest(user="carol", whitelist=[second_id]))
        assert close_of(first) == 4005
        subscribed(second, fresh("news"))  # kept
        cent.disconnect(DisconnectRequest(user="carol", client=second_id, disconnect=Disconnect(code=3503, reason="bye")))
        assert close_of(second) == 4005
        subscribed(other, fresh("news"))  # another user: untouched


def test_subscribe_and_unsubscribe_a_users_connections(gw, cent):
    topic = fresh("news")
    with ws_connect(gw, query=f"?token={make_token('erin')}") as ws:
        subscribed(ws, fresh("news"))  # registered
        cent.publish(PublishRequest(channel=topic, data="before"))
        epoch = cent.history(HistoryRequest(channel=topic)).epoch
        cent.subscribe(SubscribeRequest(user="erin", channel=topic, recover_since=StreamPosition(offset=0, epoch=epoch)))
        got = collect(ws, lambda es: any(e["type"] == "msg" for e in es))
        assert [(e["type"], e.get("id")) for e in got if e.get("topic") == topic][:2] == [("subscribed", None), ("msg", None)]
        assert [e["data"] for e in got if e["type"] == "msg"] == ["before"]  # recovered from offset 0
        cent.unsubscribe(UnsubscribeRequest(user="erin", channel=topic))
        got = collect(ws, lambda es: any(e["type"] == "unsubscribed" for e in es))
        assert [e["topic"] for e in got if e["type"] == "unsubscribed"] == [topic]


def test_subscribe_refuses_a_negative_recovery_offset(gw, cent):
    """Issue 45 item 7: `recover_since.offset` -1 gave the user's connections a loss notice from -1."""
    topic = fresh("news")
    with ws_connect(gw, query=f"?token={make_token('fay')}") as ws:
        subscribed(ws, fresh("news"))  # registered
        with pytest.raises(CentApiResponseError) as refused:
            cent.subscribe(SubscribeRequest(user="fay", channel=topic, recover_since=StreamPosition(offset=-1, epoch="e")))
        assert refused.value.code == 107 and "recover_since.offset" in refused.value.message
        cent.publish(PublishRequest(channel=topic, data="x"))
        send(ws, op="ping", id="p")
        got = collect(ws, lambda es: any(e.get("id") == "p" for e in es))
        assert not [e for e in got if e.get("topic") == topic], got


def test_refresh_expired_closes_the_users_connections_as_expired(gw, cent):
    with ws_connect(gw, query=f"?token={make_token('frank', ttl=60)}") as ws:
        subscribed(ws, fresh("news"))
        cent.refresh(RefreshRequest(user="frank", expire_at=4102444800))  # 2100: extended, still open
        subscribed(ws, fresh("news"))
        cent.refresh(RefreshRequest(user="frank", expired=True))
        assert close_of(ws) == 4011


def test_a_wrong_or_missing_key_is_cents_unauthorized_error(gw):
    for key in ("wrong", ""):
        with cent_client(gw, key) as client, pytest.raises(CentUnauthorizedError):
            client.publish(PublishRequest(channel="news.x", data=1))
    r = web.post(f"{gw.http_url}/api/info", headers={"Authorization": f"apikey {gw.admin_token}"}, json={})
    assert r.status_code == 200 and r.json()["result"]["nodes"]


def test_bad_input_is_107_and_disturbs_nobody(gw, cent):
    topic = fresh("news")
    with ws_connect(gw) as ws:
        subscribed(ws, topic)
        for request in (
            PublishRequest(channel=topic, data=1, tags={"k": "v"}),
            PublishRequest(channel=topic, data=1, skip_history=True),
            PublishRequest(channel=topic, data=None, b64data="AQ=="),
            HistoryRequest(channel=topic, limit=-5),
            HistoryRequest(channel=topic, limit=1, reverse=True, since=StreamPosition(offset=0)),
            ChannelsRequest(pattern="{unclosed"),
            SubscribeRequest(user="x", channel=topic, data={"d": 1}),
            DisconnectRequest(user="x", session="s"),
            DisconnectRequest(user="x", disconnect=Disconnect(code=4000, reason="r")),
        ):
            with pytest.raises(CentApiResponseError) as info:
                getattr(cent, request.api_method)(request)
            assert info.value.code == 107, (request, info.value)
        headers = {"X-API-Key": gw.admin_token}
        for body in (b"{not json", b'{"channel": 5, "data": 1}', b'{"channel": "x", "data": 1, "chanel": "y"}', b"[1]"):
            r = web.post(f"{gw.http_url}/api/publish", headers=headers, content=body)
            assert r.status_code == 200 and r.json()["error"]["code"] == 107, r.text
        r = web.post(f"{gw.http_url}/api/history_remove", headers=headers, json={"channel": topic})
        assert r.json()["error"]["code"] == 104
        assert cent.publish(PublishRequest(channel=topic, data="after")).offset == 1  # nothing was published before
        assert [m["data"] for m in messages(ws, topic, 1)] == ["after"]
        assert web.get(f"{gw.http_url}/api/topics/{topic}", headers=auth(gw)).json()["end"] == 1


def test_batch_runs_each_command_in_order(gw, cent):
    topic = fresh("news")
    answer = cent.batch(
        BatchRequest(
            requests=[
                PublishRequest(channel=topic, data="a"),
                PublishRequest(channel=topic, data="b"),
                HistoryRequest(channel=topic, limit=-1),
                PresenceStatsRequest(channel=fresh("room")),
            ]
        )
    )
    first, second, history, stats = answer.replies
    assert (first.offset, second.offset) == (1, 2)
    assert [p.data for p in history.publications] == ["a", "b"]
    assert (stats.num_clients, stats.num_users) == (0, 0)
    r = web.post(
        f"{gw.http_url}/api/batch",
        headers={"X-API-Key": gw.admin_token},
        json={"commands": [{"publish": {"channel": topic, "data": "c"}}, {"nope": {}}, {"publish": {"channel": topic}}]},
    )
    assert r.json() == {
        "replies": [
            {"publish": {"offset": 3, "epoch": second.epoch}},
            {"error": {"code": 104, "message": "no method 'nope'"}},
            {"error": {"code": 107, "message": "`data` is required"}},
        ]
    }


def test_a_batch_of_history_is_bounded_as_one_history_call(gw, cent):
    """Issue 45 item 4: 100 `history {limit: -1}` in one batch on a 10,000-message ring answered 83 MB (+603
    MiB); the batch's answers now share one call's bound (10,000 publications, 8 MiB), the rest 106."""
    topic = fresh("big")
    for start in range(0, 10000, 5000):
        r = web.post(
            f"{gw.http_url}/api/topics/{topic}/publish",
            headers={"Authorization": f"Bearer {gw.admin_token}"},
            json={"messages": [{"n": n} for n in range(start, start + 5000)]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    r = web.post(
        f"{gw.http_url}/api/batch",
        headers={"X-API-Key": gw.admin_token},
        timeout=30,
        json={"commands": [{"history": {"channel": topic, "limit": -1}}] * 100 + [{"history": {"channel": topic}}]},
    )
    assert len(r.content) < 1 << 20  # one answer of 10,000 small publications, 99 refusals
    first, *rest, position = r.json()["replies"]
    assert [p["offset"] for p in first["history"]["publications"]] == list(range(1, 10001))
    assert {reply["error"]["code"] for reply in rest} == {106}, rest[0]
    assert position == {"history": {"publications": [], "offset": 10000, "epoch": first["history"]["epoch"]}}


def test_async_client_publishes_and_reads_history(gw):
    topic = fresh("news")

    async def main() -> tuple[int, list]:
        async with aiohttp.ClientSession() as session:
            client = AsyncClient(f"{gw.http_url}/api", gw.admin_token, timeout=10, session=session)
            published = await client.publish(PublishRequest(channel=topic, data={"async": True}))
            history = await client.history(HistoryRequest(channel=topic, limit=5))
            return published.offset, [p.data for p in history.publications]

    assert asyncio.run(main()) == (1, [{"async": True}])


def test_api_prefix_is_configured_and_a_colliding_one_refused():
    with pytest.raises(ConfigError, match="api_prefix"):
        with run_gateway(centrifugo={"api_prefix": "/lp"}):
            pass
    with run_gateway(centrifugo={"api_prefix": "/centrifugo/api"}) as gw:
        with cent_client(gw, prefix="/centrifugo/api") as client:
            assert client.publish(PublishRequest(channel="news.p", data=1)).offset == 1
        r = web.post(f"{gw.http_url}/api/publish", headers={"X-API-Key": gw.admin_token}, json={})
        assert r.status_code == 404


def test_a_request_is_a_span_of_the_callers_trace_with_tracing_on(monkeypatch):
    from tests.gateway.test_tracing import OtlpReceiver

    receiver = OtlpReceiver()
    receiver.thread.start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK exports within 50 ms
    trace_id, parent_id = "ab" * 16, "cd" * 8
    try:
        with run_gateway(tracing={"otlp_endpoint": receiver.url, "sample_rate": 1.0}) as gw:
            r = web.post(
                f"{gw.http_url}/api/publish",
                json={"channel": "news.t", "data": 1},
                headers={"X-API-Key": gw.admin_token, "traceparent": f"00-{trace_id}-{parent_id}-01"},
            )
            assert r.json()["result"]["offset"] == 1
            (span,) = wait_for(lambda: receiver.named("centrifugo publish"), "the request's span")
    finally:
        receiver.server.shutdown()
    assert (span["trace_id"], span["parent_id"]) == (trace_id, parent_id)
    assert span["attributes"]["http.response.status_code"] == 200
