"""Handshakes that await the backend's connect hook (issue 34, items 2, 4, 5 and 11): a real slow backend
(tests/gateway/test_proxy_hooks.py's), a real gateway, real clients on loopback.

- one address holds at most `proxy.max_pending_connects_per_ip` connect calls: another address still
  connects while it floods the hook's slots;
- a session's per-address and total bounds are reserved before the hook, released on refusal;
- a revocation, a user's disconnect or a drain made while the hook is pending closes the client as it
  would have closed it registered (4010, 4005, 1012 with its hint), never admits it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import orjson
import pytest
import websockets

from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, wait_for
from tests.gateway.hook_backend import Backend, running_backend

pytestmark = pytest.mark.timeout(60)

ANONYMOUS = {"user": ""}  # the connect hook's grant that keeps the client anonymous
OTHER_ADDRESS = "127.0.0.2"  # Linux routes all of 127/8 to lo: a second client address on loopback


@pytest.fixture(scope="module")
def backend():
    yield from running_backend()


@pytest.fixture
def app(backend):
    backend.reset()
    backend.answers["connect"] = ANONYMOUS
    return backend


def hooks(app: Backend, **more: Any) -> dict[str, Any]:
    return {"connect_url": app.url("connect"), "disconnect_url": app.url("disconnect"), "timeout_s": 1.5, **more}


async def ws_outcome(url: str, source: str | None = None) -> tuple[object, str]:
    """("ok", "") when the connection is admitted and answers a ping, else (close code, reason)."""
    extra: dict[str, Any] = {"local_addr": (source, 0)} if source else {}
    try:
        async with websockets.connect(url, open_timeout=15, close_timeout=5, **extra) as ws:
            await ws.send(orjson.dumps({"op": "ping", "id": 1}).decode())
            while True:
                entries = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
                if any(e.get("id") == 1 for e in entries):
                    return "ok", ""
    except websockets.ConnectionClosed as exc:
        assert exc.rcvd is not None, exc
        return exc.rcvd.code, exc.rcvd.reason


def http(gw, source: str | None = None, **more: Any) -> httpx.AsyncClient:
    transport = web.AsyncHTTPTransport(local_address=source, limits=httpx.Limits(max_connections=200))
    return web.AsyncClient(base_url=gw.http_url, transport=transport, timeout=15, **more)


async def open_sse(client: httpx.AsyncClient, query: str = "topics=a") -> httpx.Response:
    """A GET /sse whose head (and, on 200, the first event) is read; the caller closes it."""
    response = await client.send(client.build_request("GET", f"/sse?{query}"), stream=True)
    if response.status_code == 200:
        lines = response.aiter_lines()
        response.extensions["first"] = [await anext(lines), await anext(lines)]  # event:, data:
    else:
        await response.aread()
    return response


def waiting_hooks(app: Backend, count: int) -> None:
    wait_for(lambda: len(app.received["connect"]) >= count, f"{count} connect calls at the backend")


# -- item 2: pending connect calls per address -------------------------------------------------------------


def test_one_address_flooding_the_connect_hook_leaves_room_for_another_address(app):
    # before: the flood takes the hook's 64 slots, the other address waits for one past its timeout (1013)
    app.delays["connect"] = 1.5
    with run_gateway(proxy=hooks(app, timeout_s=2.0)) as gw:

        async def scenario() -> tuple[list[tuple[object, str]], tuple[object, str]]:
            flood = [asyncio.create_task(ws_outcome(gw.ws_url)) for _ in range(120)]
            await asyncio.to_thread(waiting_hooks, app, 16)
            await asyncio.sleep(0.3)  # every handshake of the flood is in (or refused)
            assert await asyncio.to_thread(gw.call, lambda: dict(gw.hub.clients.pending.hooks_by_ip)) == {"127.0.0.1": 16}
            victim = await ws_outcome(gw.ws_url, OTHER_ADDRESS)
            return await asyncio.gather(*flood), victim

        flood, victim = asyncio.run(scenario())
        assert victim == ("ok", "")
        admitted = [outcome for outcome in flood if outcome[0] == "ok"]
        refused = [outcome for outcome in flood if outcome[0] != "ok"]
        assert len(admitted) == 16, flood  # proxy.max_pending_connects_per_ip
        assert {code for code, _ in refused} == {1013}
        assert all("max_pending_connects_per_ip" in reason for _, reason in refused), refused[:3]
        assert gw.call(lambda: dict(gw.hub.clients.pending.hooks_by_ip)) == {}


@pytest.mark.parametrize("transport", ["longpoll", "sse"])
def test_http_handshakes_beyond_the_pending_connects_of_an_address_get_429(app, transport):
    app.delays["connect"] = 1.0
    with run_gateway(proxy=hooks(app, max_pending_connects_per_ip=4)) as gw:

        async def scenario() -> list[httpx.Response]:
            async with http(gw) as client:
                opens = [client.post("/lp") if transport == "longpoll" else open_sse(client) for _ in range(10)]
                answers = await asyncio.gather(*opens)
                for answer in answers:
                    await answer.aclose()
                return answers

        answers = asyncio.run(scenario())
        assert sorted(r.status_code for r in answers) == [200 if transport == "sse" else 201] * 4 + [429] * 6
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["retry-after"] == "5"  # proxy.retry_after_s
        assert refused.json()["error"]["code"] == "rate_limited"
        assert "max_pending_connects_per_ip" in refused.json()["error"]["message"]


# -- item 5: session bounds reserved before the hook -----------------------------------------------------


def test_longpoll_session_bounds_hold_while_connect_hooks_are_pending_and_refusals_release_them(app):
    app.delays["connect"] = 0.5
    config = {"proxy": hooks(app, max_pending_connects_per_ip=100), "longpoll": {"max_sessions_per_ip": 5}}
    with run_gateway(**config) as gw:

        async def burst(count: int, source: str | None = None) -> list[int]:
            async with http(gw, source) as client:
                return sorted(r.status_code for r in await asyncio.gather(*(client.post("/lp") for _ in range(count))))

        assert asyncio.run(burst(40)) == [201] * 5 + [429] * 35
        assert gw.call(lambda: gw.hub.clients.clients_by_ip[("longpoll", "127.0.0.1")]) == 5
        # those the hook refuses hold their places while it is asked, then give them back
        app.answers["connect"] = {"error": {"code": "nope", "message": "not today"}}
        assert asyncio.run(burst(10, OTHER_ADDRESS)) == [403] * 5 + [429] * 5
        app.answers["connect"] = ANONYMOUS
        assert asyncio.run(burst(10, OTHER_ADDRESS)) == [201] * 5 + [429] * 5
    # the total (longpoll.max_sessions)
    config = {"proxy": hooks(app, max_pending_connects_per_ip=100), "longpoll": {"max_sessions": 5}}
    with run_gateway(**config) as gw:
        assert asyncio.run(burst(40)) == [201] * 5 + [503] * 35
        assert gw.call(lambda: len(gw.hub.sessions.longpoll)) == 5


def test_sse_streams_per_address_hold_while_connect_hooks_are_pending(app):
    app.delays["connect"] = 0.5
    config = {"proxy": hooks(app, max_pending_connects_per_ip=100), "sse": {"max_sessions_per_ip": 5}}
    with run_gateway(**config) as gw:

        async def burst(count: int) -> list[int]:
            async with http(gw) as client:
                answers = await asyncio.gather(*(open_sse(client) for _ in range(count)))
                statuses = sorted(r.status_code for r in answers)
                for answer in answers:
                    await answer.aclose()
                return statuses

        assert asyncio.run(burst(40)) == [200] * 5 + [429] * 35
        wait_for(lambda: gw.call(lambda: gw.hub.clients.clients_by_ip[("sse", "127.0.0.1")]) == 0, "streams gone")
        app.answers["connect"] = {"error": {"code": "nope", "message": "not today"}}
        assert asyncio.run(burst(8)) == [403] * 5 + [429] * 3
        app.answers["connect"] = ANONYMOUS
        assert asyncio.run(burst(8)) == [200] * 5 + [429] * 3


# -- item 4: a revocation or a disconnect while the hook is pending ------------------------------------------


def test_a_revocation_or_a_disconnect_during_the_connect_hook_closes_the_client_it_names(app):
    app.delays["connect"] = 1.0
    app.answers["connect"] = lambda body: {"user": body["user"]}  # the token's user
    with run_gateway(proxy=hooks(app, connect_always=True)) as gw:

        async def scenario() -> None:
            async with http(gw, headers=auth(gw)) as admin, http(gw) as client:
                ws = asyncio.create_task(ws_outcome(f"{gw.ws_url}?token={make_token('carol', jti='j-ws')}"))
                lp = asyncio.create_task(
                    client.post("/lp", headers={"Authorization": f"Bearer {make_token('dora', iat=int(time.time()) - 5)}"})
                )
                sse = asyncio.create_task(open_sse(client, f"topics=a&token={make_token('erin')}"))
                await asyncio.to_thread(waiting_hooks, app, 3)
                revoked = await admin.post("/api/revocations", json={"jti": "j-ws"})
                assert revoked.status_code == 201 and revoked.json()["disconnected"] == 0
                revoked = await admin.post("/api/revocations", json={"user": "dora"})
                assert revoked.status_code == 201 and revoked.json()["disconnected"] == 0
                gone = await admin.delete("/api/users/erin")
                assert gone.json()["disconnected"] == 0
                assert await ws == (4010, "token revoked")
                refused = await lp
                assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
                assert refused.json() == {"error": {"code": "closed", "message": "token revoked", "close_code": 4010}}
                stream = await sse
                assert stream.status_code == 200
                assert stream.extensions.get("first") == ["event: close", 'data: {"code":4005,"reason":"disconnected by admin"}']
                await stream.aclose()

        asyncio.run(scenario())
        assert gw.call(lambda: len(gw.hub.clients.conns)) == 0
        # the backend granted them: it hears of their end, as of any client's
        # each event is retried (proxy.event_retries) for up to ~10 s on a loaded machine
        wait_for(lambda: len(app.received["disconnect"]) == 3, "the disconnect events", timeout=20)
        assert sorted(e["reason"] for e in app.received["disconnect"]) == ["disconnected", "token_revoked", "token_revoked"]
        assert gw.call(lambda: len(gw.hub.clients.pending)) == 0


# -- item 11: a connect hook answering during the drain ------------------------------------------------------


def test_a_client_whose_connect_hook_answers_during_the_drain_is_closed_1012_with_a_hint(app):
    app.delays["connect"] = 1.0
    config = {"proxy": hooks(app), "server": {"drain_timeout_s": 4.0, "drain_spread_s": 1.0}}
    with run_gateway(**config) as gw:

        async def scenario() -> None:
            async with http(gw) as client:
                ws = asyncio.create_task(ws_outcome(gw.ws_url))
                lp = asyncio.create_task(client.post("/lp"))
                sse = asyncio.create_task(open_sse(client))
                await asyncio.to_thread(waiting_hooks, app, 3)
                server = gw.running.server
                assert server is not None
                gw.loop.call_soon_threadsafe(server.handle_exit, signal.SIGTERM, None)
                code, reason = await ws
                assert code == 1012 and reason.startswith("restarting: reconnect in "), (code, reason)
                refused = await lp
                body = refused.json()["error"]
                assert refused.status_code == 503 and body["code"] == "closed" and body["close_code"] == 1012
                assert 0 <= body["retry_ms"] <= 1000 and body["message"] == f"restarting: reconnect in {body['retry_ms']} ms"
                assert int(refused.headers["retry-after"]) == -(-body["retry_ms"] // 1000)
                stream = await sse
                event, data = stream.extensions["first"]
                assert event == "event: close" and orjson.loads(data[6:])["code"] == 1012
                await stream.aclose()

        asyncio.run(scenario())
        server = gw.running.server
        assert server is not None
        wait_for(lambda: server.drain_report is not None, "the drain to end")
        assert server.drain_report is not None and server.drain_report["connections_left"] == 0
        assert gw.call(lambda: len(gw.hub.clients.conns)) == 0
