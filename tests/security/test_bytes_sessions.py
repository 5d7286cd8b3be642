"""Session transports (issue 24): the SSE `id:` line is bounded whatever the subscriptions (it grew to 265 KB
per one-message event with 1,000), and Last-Event-ID recovery still works; a long-poll client closed between
two polls learns why on its next poll instead of `404 unknown_session`."""

from __future__ import annotations

import pytest

from gateway.testing import run_gateway
from gateway.transports.sse import MAX_ID_BYTES
from tests import web
from tests.gateway.gw_helpers import Ingest, auth
from tests.gateway.sse_client import SseClient

pytestmark = pytest.mark.timeout(60)

LONG = "x" * 200


def _topics(n: int) -> list[str]:
    return [f"chat.{LONG}{i}" for i in range(n)]


def _msgs(entries, topic=None):
    return [e["seq"] for e in entries if e["type"] == "msg" and (topic is None or e["topic"] == topic)]


def test_the_sse_id_line_is_bounded_with_1000_subscriptions_and_recovers():
    names = _topics(1000)
    with run_gateway(limits={"subscribe_burst": 1000}) as gw:  # 1000 subscribes at once (limits.subscribe_rate)
        gw.call(lambda: [gw.hub.scheduler.engine.resolve(name) for name in names])  # past the creation limits
        publisher = Ingest(gw)
        with SseClient(gw, "?topics=", rcvbuf=1 << 20) as sse, web.Client(base_url=gw.http_url) as http:
            secret = sse.session()["session"]
            for start in range(0, 1000, 100):
                commands = [{"op": "subscribe", "topic": name} for name in names[start : start + 100]]
                assert http.post(f"/sse/{secret}", json=commands).status_code == 202
            got = sse.collect(lambda g: sum(e["type"] == "subscribed" for e in g) == 1000, timeout=20)
            epochs = {e["topic"]: e["epoch"] for e in got if e["type"] == "subscribed"}
            for i in (0, 500, 999):
                publisher.send({"topic": names[i], "data": i})
            publisher.sync()
            ids = []
            while len(_msgs(got)) < 3:
                event = sse.next_event()
                got += event.json()
                if event.id is not None:
                    ids.append(event.id)
            assert ids and max(len(i) for i in ids) <= MAX_ID_BYTES  # was ~210 KB per event here
            last = sse.last_event_id
        # published while away: recovered from the compact id, nothing missed, nothing twice
        publisher.send({"topic": names[500], "data": "away"}, {"topic": names[3], "data": "away"})
        publisher.sync()
        with SseClient(gw, "?topics=", headers={"Last-Event-ID": last}, rcvbuf=1 << 20) as again:
            again.session()
            back = again.collect(lambda g: len(_msgs(g)) >= 2, timeout=20)
            assert not [e for e in back if e["type"] in ("error", "loss")]
            assert _msgs(back, names[500]) == [1] and _msgs(back, names[3]) == [0]
            assert _msgs(back, names[0]) == [] and _msgs(back, names[999]) == []
            subscribed = {e["topic"]: e for e in back if e["type"] == "subscribed"}
            assert subscribed[names[0]]["seq"] == 1 and subscribed[names[0]]["epoch"] == epochs[names[0]]
        publisher.close()


def test_an_unknown_compact_recovery_point_is_a_bad_request():
    with run_gateway() as gw, SseClient(gw, "?topics=chat.a", headers={"Last-Event-ID": "~nosuchkey.3"}) as sse:
        sse.session()
        first = sse.next_event().json()
        assert first[0]["type"] == "error" and first[0]["code"] == "bad_request"
        assert first[1]["type"] == "subscribed"


def test_a_long_poll_client_closed_between_polls_learns_why():
    with run_gateway() as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        created = http.post("/lp").json()
        session, client_id = created["session"], created["client_id"]
        assert http.delete(f"/api/clients/{client_id}", headers=auth(gw)).status_code == 200  # no poll waits
        answer = http.get(f"/lp/{session}")
        assert answer.status_code == 200, answer.text  # was 404 unknown_session
        body = answer.json()
        assert body["batch"] is None
        assert (
            body["entries"] == [{"type": "error", "code": "closed", "message": "kicked by operator", "close_code": 4000}]
            or body["entries"][0]["close_code"] == 4000
        )
        assert http.get(f"/lp/{session}").status_code == 404  # told once
        deleted = http.post("/lp").json()["session"]
        assert http.delete(f"/lp/{deleted}").status_code == 204
        assert http.get(f"/lp/{deleted}").status_code == 404  # closed by the client itself: nothing to tell
