"""The one handshake of the client transports (gateway/admission.py): what `open_client` admits,
refuses and in which order, and that each transport gives a refusal the same wire form on every path it
has; `TransportOff` for every disabled HTTP route, the WebSocket protocol's 403 when /ws is off."""

from __future__ import annotations

import asyncio
import types

import orjson
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from core.errors import RequestError
from gateway import commands
from gateway.admission import ClientIdRefused, bearer_token, open_client
from gateway.config import load_config
from gateway.errors import BadToken, TokenExpired, TooManySessions, TooManySessionsFromAddress, TooManyTokenChecks
from gateway.hub import Hub
from gateway.testing import DEFAULTS, make_token, run_gateway
from gateway.transports.handshake import close_reason
from tests import web
from tests.gateway.gw_helpers import collect, send, ws_connect

pytestmark = pytest.mark.timeout(60)

PEER = ("192.0.2.7", 40001)


def make_hub(**sections) -> Hub:
    async def make() -> Hub:
        overrides = {name: {**DEFAULTS.get(name, {}), **keys} for name, keys in sections.items()}  # type: ignore[dict-item]
        return Hub(load_config(overrides={**DEFAULTS, **overrides}, environ={}))

    return asyncio.run(make())


def refusal(call) -> RequestError:
    with pytest.raises(RequestError) as info:
        call()
    return info.value


@pytest.mark.parametrize("transport, prefix", [("ws", "ws-"), ("sse", "sse-"), ("longpoll", "lp-")])
def test_an_anonymous_and_a_token_client_get_an_identity_named_by_the_gateway(transport, prefix):
    hub = make_hub()
    anonymous = open_client(hub, transport, PEER)
    assert anonymous.client_id.startswith(prefix) and len(anonymous.client_id) == len(prefix) + 16
    assert (anonymous.transport, anonymous.peer, anonymous.ip, anonymous.principal) == (
        transport,
        "192.0.2.7:40001",
        "192.0.2.7",
        None,
    )
    token = make_token("ann", subscribe=["news.*"])
    named = open_client(
        hub, transport, PEER, **({"authorization": f"Bearer {token}"} if transport == "longpoll" else {"token": token})
    )
    assert named.user == "ann" and named.principal.subscribe == ("news.*",)
    assert named.client_id != anonymous.client_id
    assert open_client(hub, transport, None).peer == ":0"


def test_refusals_carry_the_codes_of_docs_protocol():
    hub = make_hub()
    cases = [
        (lambda: open_client(hub, "ws", PEER, requested_id=""), ClientIdRefused, 4006, 400),
        (lambda: open_client(hub, "sse", PEER, requested_id="me", token=make_token("ann")), ClientIdRefused, 4006, 400),
        (lambda: open_client(hub, "ws", PEER, token="junk"), BadToken, 4001, 401),
        (lambda: open_client(hub, "sse", PEER, token=make_token("ann", ttl=-60)), TokenExpired, 4011, 401),
        (lambda: open_client(hub, "longpoll", PEER, authorization="Bearer junk"), BadToken, 4001, 401),
        (lambda: open_client(hub, "longpoll", PEER, authorization="Basic YTpi"), BadToken, 4001, 401),
    ]
    for call, kind, close_code, status in cases:
        exc = refusal(call)
        assert type(exc) is kind and (exc.close_code, exc.http_status) == (close_code, status), exc
    assert refusal(cases[0][0]).message == "?id= is not accepted: identity comes from ?token="
    assert hub.clients.clients_by_ip == {}  # opening registers nothing: the transport registers its connection


def test_the_bounds_come_first_then_the_id_then_the_token_checked_within_the_address_rate():
    hub = make_hub(
        longpoll={"max_sessions": 2, "max_sessions_per_ip": 1},
        sse={"max_sessions_per_ip": 1},
        auth={"rate_per_ip": 0.001, "burst_per_ip": 2},
    )
    hub.clients.clients_by_ip[("sse", PEER[0])] = 1
    full = refusal(lambda: open_client(hub, "sse", PEER, token="junk", requested_id="me"))
    assert type(full) is TooManySessionsFromAddress and full.http_status == 429 and full.close_code is None
    assert full.message == "at most 1 SSE streams per address"
    assert open_client(hub, "sse", ("192.0.2.8", 1)).transport == "sse"  # another address
    assert open_client(hub, "ws", PEER).transport == "ws"  # another transport: WebSocket has no such bound
    hub.clients.clients_by_ip[("longpoll", PEER[0])] = 1
    full = refusal(lambda: open_client(hub, "longpoll", PEER, authorization="Basic x"))
    assert type(full) is TooManySessionsFromAddress and full.message == "at most 1 sessions per address"
    for secret in ("a", "b"):
        hub.sessions.longpoll.add(types.SimpleNamespace(secret=secret))
    total = refusal(lambda: open_client(hub, "longpoll", ("192.0.2.9", 1), authorization="Basic x"))
    assert type(total) is TooManySessions and total.http_status == 503
    assert total.message == "the long-poll session limit is reached"
    # two token checks in the burst, then the address is not checked at all (4029 / 429), whatever the token
    assert type(refusal(lambda: open_client(hub, "ws", PEER, token="junk"))) is BadToken
    assert open_client(hub, "ws", PEER, token=make_token("ann")).user == "ann"
    limited = refusal(lambda: open_client(hub, "ws", PEER, token=make_token("ann")))
    assert type(limited) is TooManyTokenChecks and (limited.close_code, limited.http_status) == (4029, 429)
    assert open_client(hub, "ws", PEER).principal is None  # no token, no check: still admitted
    counted = hub.bad_input.by_source
    assert (counted["sse"], counted["longpoll"], counted["ws"]) == (1, 1, 2)


def test_the_bearer_header_and_the_close_reason():
    assert bearer_token(None) is None and bearer_token("") is None and bearer_token(" x") is None
    assert bearer_token("Bearer  abc ") == "abc" and bearer_token("bearer abc") == "abc"
    with pytest.raises(BadToken, match="Bearer <token>"):
        bearer_token("Basic abc")
    long = BadToken("é" * 100)  # 200 bytes of UTF-8: cut to 120 bytes, on a character boundary
    assert close_reason(long) == "é" * 60


def close_of(ws) -> tuple[int, str]:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=5)
    assert info.value.rcvd is not None, "the server sent no close frame"
    return info.value.rcvd.code, info.value.rcvd.reason


def test_ws_refusals_close_with_their_codes_and_a_failing_client_with_1011(monkeypatch):
    config = {"auth": {"rate_per_ip": 0.001, "burst_per_ip": 2}}
    with run_gateway(**config) as gw:
        for query, code, words in [
            ("?id=me", 4006, "?id= is not accepted"),
            ("?token=junk", 4001, "invalid token"),
            (f"?token={make_token('ann', ttl=-60)}", 4011, "expired"),
            ("?token=x", 4029, "too many token checks"),
        ]:
            with ws_connect(gw, query=query) as ws:
                got, reason = close_of(ws)
                assert got == code and words in reason, (query, got, reason)
        assert gw.call(lambda: len(gw.hub.clients.conns)) == 0
        real = commands.handle

        def failing(session, payload):
            if b"boom" in (payload if isinstance(payload, bytes) else payload.encode()):
                raise RuntimeError("a bug")
            return real(session, payload)

        monkeypatch.setattr(commands, "handle", failing)  # what each new session reads its messages with
        with ws_connect(gw) as ws, ws_connect(gw) as other:
            send(ws, op="ping", id=1)
            assert any(e.get("result") == "pong" for e in collect(ws, lambda got: got))
            send(ws, op="boom")
            assert close_of(ws) == (1011, "internal error")
            send(other, op="ping", id=2)
            assert any(e.get("result") == "pong" for e in collect(other, lambda got: got))
        assert gw.call(lambda: gw.hub.clients.disconnects[("ws", "error")]) == 1


def test_every_route_of_a_disabled_transport_gets_the_one_answer():
    off = {"sse": {"enabled": False}, "longpoll": {"enabled": False}, "websocket": {"enabled": False}}
    with run_gateway(**off) as gw, web.Client(base_url=gw.http_url) as http:
        for method, path, name in [
            ("GET", "/sse?topics=a", "the SSE transport is disabled (sse.enabled)"),
            ("POST", "/sse/x", "the SSE transport is disabled (sse.enabled)"),
            ("DELETE", "/sse/x", "the SSE transport is disabled (sse.enabled)"),
            ("POST", "/lp", "the long-poll transport is disabled (longpoll.enabled)"),
            ("GET", "/lp/x", "the long-poll transport is disabled (longpoll.enabled)"),
            ("POST", "/lp/x", "the long-poll transport is disabled (longpoll.enabled)"),
            ("DELETE", "/lp/x", "the long-poll transport is disabled (longpoll.enabled)"),
        ]:
            r = http.request(method, path)
            assert (r.status_code, r.json()) == (404, {"error": {"code": "not_found", "message": name}}), (method, path)
        r = http.put("/lp/x")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(gw)
        refusal = refused.value.response
        assert refusal.status_code == 403 and orjson.loads(refusal.body) == {
            "error": {"code": "forbidden", "message": "the WebSocket transport is disabled (websocket.enabled)"}
        }
