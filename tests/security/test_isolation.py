"""One client cannot read, steal or block another's session, queue or name (issue 8, isolation rows)."""

from __future__ import annotations

import base64
import re

import pytest
from websockets.exceptions import ConnectionClosed

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, collect, recv_entries, send, ws_connect

pytestmark = pytest.mark.timeout(60)


def msgs(entries):
    return [e for e in entries if e["type"] == "msg"]


@pytest.fixture(scope="module")
def shared():
    """One default gateway for the three tests (each its own sessions, clients and users)."""
    with run_gateway() as gw:
        yield gw


def test_long_poll_session_ids_are_128_bit_secrets_unrelated_to_client_ids(shared):
    with web.Client(base_url=shared.http_url, timeout=10) as http:
        created = [http.post("/lp").json() for _ in range(20)]
        secrets_seen = {c["session"] for c in created}
        assert len(secrets_seen) == 20
        for c in created:
            assert re.fullmatch(r"[A-Za-z0-9_-]{22}", c["session"])
            assert len(base64.urlsafe_b64decode(c["session"] + "==")) == 16  # 128 bits from `secrets`
        victim, attacker = created[0], created[1]
        # what an attacker can learn of a neighbour (its client id) opens nothing
        for path in (f"/lp/{victim['client_id']}", f"/lp/{attacker['session'][:-1]}x"):
            assert http.get(path).status_code == 404
            assert http.post(path, json={"op": "ping"}).status_code == 404
            assert http.delete(path).status_code == 404
        assert http.delete(f"/lp/{victim['session']}").status_code == 204


def test_chosen_names_are_never_accepted_so_none_can_be_pre_claimed_or_probed(shared):
    gw = shared
    with ws_connect(gw) as first:
        send(first, op="rpc", method="whoami", id=1)
        generated = recv_entries(first)[0]["result"]["client_id"]
    for name in ("alice", generated, "ws-0000000000000001"):
        with ws_connect(gw, query=f"?id={name}") as ws:
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=5)
            assert info.value.rcvd.code == 4006  # the same answer whoever is online
    with ws_connect(gw) as ordinary:  # the next ordinary clients are unaffected
        send(ordinary, op="ping", id=2)
        assert recv_entries(ordinary)[0]["result"] == "pong"
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        assert http.post("/lp").status_code == 201


def test_a_private_queue_belongs_to_the_token_user_and_a_reconnect_takes_it_over(shared):
    gw = shared
    pub = Ingest(gw)
    with (
        ws_connect(gw, query=f"?token={make_token('alice')}") as old,
        ws_connect(gw, query=f"?token={make_token('mallory')}") as mallory,
    ):
        send(old, op="subscribe", topic="private.inbox")
        send(mallory, op="subscribe", topic="private.inbox")
        recv_entries(old), recv_entries(mallory)
        pub.send({"topic": "private.inbox", "client": "alice", "data": "a1"})
        pub.sync()
        assert [m["data"] for m in msgs(collect(old, msgs))] == ["a1"]
        with ws_connect(gw, query=f"?token={make_token('alice')}") as new:  # a second tab, or a reconnect
            send(new, op="subscribe", topic="private.inbox")
            subscribed = recv_entries(new)[0]
            assert subscribed["type"] == "subscribed" and subscribed["seq"] == 1
            closed = collect(old, lambda g: any(e["type"] == "closed" for e in g))
            assert closed[-1] == {"type": "closed", "topic": "private.inbox", "reason": "taken_over"}
            pub.send({"topic": "private.inbox", "client": "alice", "data": "a2"})
            pub.sync()
            assert [m["data"] for m in msgs(collect(new, msgs))] == ["a2"]
        with pytest.raises(TimeoutError):
            mallory.recv(timeout=0.3)  # nothing of alice's ever reached mallory
