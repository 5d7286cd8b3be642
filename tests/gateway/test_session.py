"""One `ClientSession` per client connection (gateway/session.py): its open in order (the handshake's bounds,
`?id=` and token, then the connect hook, then the registration), its refusals at each step, and what its
transport tells it (a message that fails closes only its client, with 1011; a client gone before it opened
gives its places back). A real gateway, a real hook backend (tests/gateway/hook_backend.py), real clients
on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
import pytest

import gateway.commands
from gateway.session import ClientSession, LateRefused
from gateway.testing import make_token, run_gateway
from gateway.transports.longpoll import LongPollSession
from tests import web
from tests.gateway.gw_helpers import auth, wait_for
from tests.gateway.hook_backend import Backend
from tests.gateway.sse_client import SseClient

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
PEER = ("127.0.0.1", 1)


@pytest.fixture
def app(app):  # the folder's backend (conftest.py), admitting clients anonymous
    app.answers["connect"] = {"user": ""}
    return app


def hooks(app: Backend, **more: Any) -> dict[str, Any]:
    return {"connect_url": app.url("connect"), "disconnect_url": app.url("disconnect"), "timeout_s": 5, **more}


def on_loop(gw, scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `scenario()` on the gateway's loop (the hub is not thread-safe)."""
    return asyncio.run_coroutine_threadsafe(scenario(), gw.loop).result(20)


def places(gw, transport: str) -> tuple[int, int, int]:
    """(clients registered, clients on their way, the address's count in `transport`'s bound)."""
    return gw.call(
        lambda: (len(gw.hub.clients.conns), len(gw.hub.clients.pending), gw.hub.clients.clients_by_ip[(transport, "127.0.0.1")])
    )


def test_a_session_opens_after_its_hook_and_a_disconnect_meanwhile_refuses_it_as_it_opens(app):
    app.answers["connect"] = {"user": "ann"}
    with run_gateway(proxy=hooks(app)) as gw, web.Client(base_url=gw.http_url, headers=auth(gw)) as admin:
        hub = gw.hub

        async def opened() -> None:
            session = ClientSession.begin(hub, "longpoll", PEER)
            # on its way: its place held in the bounds, not registered, the hook not asked yet
            assert session.awaits_hook and not session.live and not app.received["connect"]
            assert (len(hub.clients.pending), hub.sessions.longpoll.reserved) == (1, 1)
            await session.pass_backend(lambda name: [])
            assert len(app.received["connect"]) == 1 and session.identity.user == "ann" and not session.live
            conn = LongPollSession(session)
            session.open(conn, ready=False)
            conn.start()
            assert session.live and hub.clients.conns[session.identity.client_id] is conn
            assert (len(hub.clients.pending), hub.sessions.longpoll.reserved, len(hub.sessions.longpoll)) == (0, 0, 1)
            with pytest.raises(RuntimeError, match="not opening"):
                session.open(conn)
            session.close(1000, "bye")
            assert not session.live and not hub.clients.conns and not len(hub.sessions.longpoll)
            session.gone()  # the transport's end of a closed client: nothing more

        on_loop(gw, opened)

        async def begun() -> ClientSession:
            session = ClientSession.begin(hub, "longpoll", PEER)
            await session.pass_backend(lambda name: [])
            return session

        late = on_loop(gw, begun)
        assert admin.delete("/api/users/ann").json()["disconnected"] == 0  # nobody registered: noted for those on their way

        async def refused() -> None:
            with pytest.raises(LateRefused) as refusal:
                late.open(LongPollSession(late), ready=False)
            assert (refusal.value.close_code, refusal.value.message) == (4005, "disconnected by admin")
            assert not late.live and not hub.clients.conns
            assert (len(hub.clients.pending), hub.sessions.longpoll.reserved) == (0, 0)
            late.gone()  # the transport's end of a refused client: nothing more

        on_loop(gw, refused)
        wait_for(lambda: len(app.received["disconnect"]) == 2, "the backend hearing of both ends")
        assert sorted(body["reason"] for body in app.received["disconnect"]) == ["closed", "disconnected"]


@pytest.mark.parametrize("transport", ["longpoll", "sse"])
def test_the_handshake_refuses_before_the_hook_is_asked_and_the_hook_before_registration(app, transport):
    app.delays["connect"] = 1.0
    with (
        run_gateway(proxy=hooks(app), longpoll={"max_sessions_per_ip": 1}, sse={"max_sessions_per_ip": 1}) as gw,
        web.Client(base_url=gw.http_url, timeout=10) as http,
    ):

        def refused(token: str, query: str = "") -> object:
            if transport == "longpoll":
                answer = http.post("/lp", headers={"Authorization": f"Bearer {token}"})
                return answer.status_code
            with SseClient(gw, f"?topics=a&token={token}{query}") as sse:
                if sse.status != 200:
                    return sse.status
                event = sse.next_event()
                assert event is not None and event.event == "close"
                return event.json()["code"]

        # the token, and `?id=` (SSE), are refused without asking the backend
        assert refused("junk") == (401 if transport == "longpoll" else 4001)
        if transport == "sse":
            assert refused(make_token("ann"), "&id=me") == 4006
        assert not app.received["connect"]
        # a client awaiting the hook holds its address's place, and is registered only once it answered
        opened: list[object] = []
        client = threading.Thread(target=lambda: opened.append(open_one(gw, http, transport)))
        client.start()
        wait_for(lambda: len(app.received["connect"]) == 1, "the connect call")
        assert places(gw, transport) == (0, 1, 1)
        # the address is at its bound: refused before its token is checked or the hook asked
        assert refused("junk") == 429
        client.join(10)
        assert opened == ["open"] and len(app.received["connect"]) == 1


def open_one(gw, http: httpx.Client, transport: str) -> str:
    """Open a client and see it registered."""
    if transport == "longpoll":
        answer = http.post("/lp")
        assert answer.status_code == 201, answer.text
    else:
        with SseClient(gw, "?topics=a") as sse:
            assert sse.status == 200 and "client_id" in sse.session()
            assert places(gw, transport)[:2] == (1, 0)
        return "open"
    assert places(gw, transport)[:2] == (1, 0)
    return "open"


@pytest.mark.parametrize("transport", ["longpoll", "sse"])
def test_a_message_that_fails_closes_only_its_client_with_1011(transport, monkeypatch):
    real = gateway.commands.handle

    def failing(session, payload):
        if b"boom" in (payload if isinstance(payload, bytes) else payload.encode()):
            raise RuntimeError("a bug")
        return real(session, payload)

    monkeypatch.setattr(gateway.commands, "handle", failing)
    with run_gateway() as gw, web.Client(base_url=gw.http_url, timeout=10) as http:
        if transport == "longpoll":
            victim, other = (http.post("/lp").json()["session"] for _ in range(2))
            assert http.post(f"/lp/{victim}", json={"op": "boom"}).json() == {"accepted": 0}
            entries = http.get(f"/lp/{victim}").json()["entries"]
            assert [(e["type"], e["close_code"], e["message"]) for e in entries] == [("error", 1011, "internal error")]
            assert http.post(f"/lp/{other}", json={"op": "ping", "id": 1}).json() == {"accepted": 1}
            assert any(e.get("result") == "pong" for e in http.get(f"/lp/{other}").json()["entries"])
        else:
            with SseClient(gw, "?topics=a") as victim, SseClient(gw, "?topics=a") as other:
                secret, other_secret = victim.session()["session"], other.session()["session"]
                assert http.post(f"/sse/{secret}", json={"op": "boom"}).json() == {"accepted": 0}
                event = victim.next_event()
                while event is not None and event.event != "close":
                    event = victim.next_event()
                assert event is not None and event.json() == {"code": 1011, "reason": "internal error"}
                assert http.post(f"/sse/{other_secret}", json={"op": "ping", "id": 1}).json() == {"accepted": 1}
                assert any(e.get("result") == "pong" for e in other.collect(lambda got: any("result" in e for e in got)))
        assert gw.call(lambda: gw.hub.clients.disconnects[(transport, "error")]) == 1


def test_an_sse_client_gone_while_awaiting_the_hook_gives_its_places_back(app):
    app.delays["connect"] = 1.0
    with run_gateway(proxy=hooks(app)) as gw:
        sse = SseClient(gw, "?topics=a", read_head=False)
        wait_for(lambda: len(app.received["connect"]) == 1, "the connect call")
        assert places(gw, "sse") == (0, 1, 1)
        sse.close()
        wait_for(lambda: places(gw, "sse") == (0, 0, 0), "the places given back")
        assert not app.received["disconnect"]  # never registered
