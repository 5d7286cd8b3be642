"""The Centrifugo server API on a cluster (docs/centrifugo.md, "Server API"): two gateway processes on a real
Redis, the real `cent` client on node A. A user's connection on node B is subscribed, sent a publication,
read back with history on B, and disconnected, all from A; A, which holds no subscriber of the topic, answers
its stream position only; info lists both nodes."""

from __future__ import annotations

import pytest
import requests
from cent import (
    Client,
    DisconnectRequest,
    HistoryRequest,
    InfoRequest,
    PublishRequest,
    SubscribeRequest,
)
from cent.exceptions import CentApiResponseError

from gateway.testing import TEST_JWT_SECRET, make_token
from tests.cluster.cluster_helpers import TOKEN, collect
from tests.cluster.test_user_control_cluster import close_of, ws_as
from tests.gateway.gw_helpers import wait_for

AUTH = {"jwt_secret": TEST_JWT_SECRET, "leeway_s": 0.0}


def cent_on(node) -> Client:
    session = requests.Session()
    session.trust_env = False
    return Client(f"{node.http_url}/api", TOKEN, timeout=10, session=session)


def test_cent_on_one_node_reaches_a_users_connection_on_the_other(nodes):
    a, b = nodes.start("a", auth=AUTH), nodes.start("b", auth=AUTH)
    with cent_on(a) as on_a, cent_on(b) as on_b, ws_as(b, make_token("jo")) as jo:
        wait_for(lambda: any(n.num_clients == 1 for n in on_a.info(InfoRequest()).nodes), "jo on node b")
        on_a.subscribe(SubscribeRequest(user="jo", channel="news.c"))
        got = collect(jo, lambda es: any(e["type"] == "subscribed" for e in es))
        epoch = next(e for e in got if e["type"] == "subscribed")["epoch"]
        published = on_a.publish(PublishRequest(channel="news.c", data={"n": 1}))
        assert (published.offset, published.epoch) == (1, epoch)
        got = collect(jo, lambda es: any(e["type"] == "msg" for e in es))
        assert [(e["seq"], e["data"]) for e in got if e["type"] == "msg"] == [(0, {"n": 1})]
        held = on_b.history(HistoryRequest(channel="news.c", limit=-1))
        assert [(p.offset, p.data) for p in held.publications] == [(1, {"n": 1})] and held.epoch == epoch
        position = on_a.history(HistoryRequest(channel="news.c"))
        assert (position.publications, position.offset, position.epoch) == ([], 1, epoch)
        with pytest.raises(CentApiResponseError) as info:
            on_a.history(HistoryRequest(channel="news.c", limit=-1))
        assert info.value.code == 108
        assert len(on_a.info(InfoRequest()).nodes) == 2
        on_a.disconnect(DisconnectRequest(user="jo"))
        assert close_of(jo)[0] == 4005
