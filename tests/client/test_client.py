"""fanout_client against real gateways (gateway.testing.run_gateway, ephemeral ports on 127.0.0.1): in-order
delivery, publish and rpc, a gateway replaced mid-stream (one `epoch` loss), a cut connection (no gap, no
duplicate), the queue bound's policy, token refresh and the close codes of docs/client.md.

Each test is one coroutine run under a deadline (`run`); the gateways run in their own threads, started and
stopped off the event loop (`gateway`)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

import fanout_client
from fanout_client import FanoutError, Loss, Message
from gateway.testing import GatewayHandle, make_token, run_gateway
from loadtest.ports import free_port
from tests import web
from tests.e2e.browser_proxy import TcpProxy

pytestmark = pytest.mark.timeout(60)

#: quick reconnects, short waits: a test lasts seconds
FAST: dict[str, Any] = {"backoff_base": 0.05, "backoff_max": 0.3, "request_timeout": 5.0, "start_timeout": 5.0}


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await coro

    asyncio.run(bounded())


class Gateway:
    """A gateway started and stopped from a coroutine (run_gateway blocks while it starts and stops)."""

    def __init__(self, **overrides: Any) -> None:
        self._cm = run_gateway(**overrides)
        self.gw: GatewayHandle | None = None

    async def start(self) -> GatewayHandle:
        self.gw = await asyncio.to_thread(self._cm.__enter__)
        return self.gw

    async def stop(self) -> None:
        if self.gw is not None:
            self.gw = None
            await asyncio.to_thread(self._cm.__exit__, None, None, None)


#: the module's gateway of the defaults (`shared_gateway`), which `gateway()` without overrides hands out
_SHARED: list[GatewayHandle] = []


@pytest.fixture(scope="module", autouse=True)
def shared_gateway() -> Iterator[None]:
    """One gateway of the defaults for the tests that change no setting: each has topics of its own."""
    with run_gateway() as gw:
        _SHARED.append(gw)
        yield
        _SHARED.clear()


@contextlib.asynccontextmanager
async def gateway(**overrides: Any) -> AsyncIterator[GatewayHandle]:
    if not overrides and _SHARED:
        yield _SHARED[0]
        return
    g = Gateway(**overrides)
    gw = await g.start()
    try:
        yield gw
    finally:
        await g.stop()


async def admin(gw: GatewayHandle, method: str, path: str, body: Any = None) -> Any:
    async with web.AsyncClient(timeout=5) as http:
        r = await http.request(method, f"{gw.http_url}{path}", json=body, headers={"Authorization": f"Bearer {gw.admin_token}"})
    assert r.status_code < 300, r.text
    return r.json()


async def publish(gw: GatewayHandle, topic: str, messages: list[Any], **extra: Any) -> list[int]:
    return (await admin(gw, "POST", f"/api/topics/{topic}/publish", {"messages": messages, **extra}))["seqs"]


async def take(sub: fanout_client.Subscription, count: int, timeout: float = 5.0) -> list[fanout_client.Event]:
    return [await sub.get(timeout) for _ in range(count)]


async def nothing_more(sub: fanout_client.Subscription, seconds: float = 0.3) -> None:
    with pytest.raises(TimeoutError):
        await sub.get(seconds)


async def until(predicate: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def seqs(events: list[fanout_client.Event]) -> list[int]:
    assert all(isinstance(e, Message) for e in events), events
    return [e.seq for e in events if isinstance(e, Message)]


# -- delivery, publish, rpc -------------------------------------------------------------------------------------


def test_messages_arrive_in_order_and_publish_and_rpc_round_trip() -> None:
    async def main() -> None:
        async with gateway() as gw, fanout_client.connect(gw.http_url, **FAST) as client:
            assert client.state == "connected"
            sub = await client.subscribe("chat.order")
            assert (sub.kind, sub.next_seq) == ("ring", 0) and sub.epoch
            await publish(gw, "chat.order", [{"n": i} for i in range(200)])
            got = await take(sub, 200)
            assert seqs(got) == list(range(200))
            assert [e.data for e in got] == [{"n": i} for i in range(200)]  # type: ignore[union-attr]  # all messages
            assert {e.topic for e in got} == {"chat.order"} and {e.epoch for e in got} == {sub.epoch}

            seq = await client.publish("chat.order", {"from": "python"})
            assert seq == 200 and await sub.get(5) == Message("chat.order", 200, {"from": "python"}, sub.epoch)
            assert await client.rpc("echo", {"a": [1, 2]}) == {"a": [1, 2]}
            assert isinstance(await client.rpc("time"), int)
            who = await client.rpc("whoami")
            assert who["transport"] == "ws" and who["user"] is None and who["client_id"].startswith("ws-")
            with pytest.raises(FanoutError) as refused:
                await client.rpc("nope")
            assert refused.value.code == "unknown_method"
            with pytest.raises(FanoutError) as refused:
                await client.publish("feed.readonly", 1)  # feed.* takes no client publishes
            assert refused.value.code == "forbidden"
            with pytest.raises(FanoutError) as refused:
                await client.subscribe("private.inbox")  # private topics need a token
            assert refused.value.code == "forbidden" and "private.inbox" not in client.subscriptions
            with pytest.raises(FanoutError) as refused:
                await client.subscribe("chat.order")
            assert refused.value.code == "already_subscribed"

            await sub.unsubscribe()
            assert [e async for e in sub] == [] and sub.closed_reason == "unsubscribed"
            again = await client.subscribe("chat.order", since=fanout_client.Position(sub.epoch or "", 198))
            assert seqs(await take(again, 3)) == [198, 199, 200]  # a saved position replays exactly
            await nothing_more(again)
            assert client.reconnects == 0
        assert client.state == "closed" and client.close_error is None
        assert [e async for e in again] == [] and again.closed_reason == "client_closed"

    run(main())


# -- reconnects and recovery ------------------------------------------------------------------------------------


def test_a_gateway_replaced_mid_stream_is_one_epoch_loss_then_the_stream_goes_on() -> None:
    topic = "feed.restart"

    async def main() -> None:
        port = free_port()
        first = Gateway(server={"port": port})
        gw = await first.start()
        states: list[str] = []
        async with fanout_client.connect(gw.http_url, **FAST, on_state=lambda s, c: states.append(s)) as client:
            sub = await client.subscribe(topic)
            old_epoch = sub.epoch
            await publish(gw, topic, [{"n": i} for i in range(5)])
            assert seqs(await take(sub, 5)) == list(range(5))
            await first.stop()
            await until(lambda: client.state != "connected", "the client to see the gateway go")
            second = Gateway(server={"port": port})
            gw = await second.start()
            try:
                await until(lambda: sub.subscribed_count >= 2, "the resubscribe")
                await publish(gw, topic, [{"n": i} for i in range(5, 10)])
                loss, *rest = await take(sub, 6)
                await nothing_more(sub)
            finally:
                await second.stop()
        assert isinstance(loss, Loss) and sub.epoch != old_epoch
        assert loss == Loss(topic, 5, None, "epoch", sub.epoch or "")
        assert seqs(rest) == list(range(5)) and [e.data["n"] for e in rest] == list(range(5, 10))  # type: ignore[union-attr]
        assert {e.epoch for e in rest} == {sub.epoch}
        assert client.reconnects >= 1 and "disconnected" in states

    run(main())


def test_a_cut_connection_resumes_without_gap_or_duplicate() -> None:
    topic = "feed.cut"

    async def main() -> None:
        async with gateway() as gw:
            with TcpProxy(gw.http_port) as proxy:
                async with fanout_client.connect(proxy.url, **FAST) as client:
                    sub = await client.subscribe(topic)
                    await publish(gw, topic, [{"n": i} for i in range(5)])
                    assert seqs(await take(sub, 5)) == list(range(5))
                    proxy.refusing = True
                    proxy.cut()
                    await until(lambda: client.state != "connected", "the client to see the cut")
                    await publish(gw, topic, [{"n": i} for i in range(5, 20)])  # while away: replayed on return
                    proxy.refusing = False
                    assert seqs(await take(sub, 15)) == list(range(5, 20))
                    await publish(gw, topic, [{"n": 20}])
                    assert seqs(await take(sub, 1)) == [20]
                    await nothing_more(sub)
                    assert client.reconnects >= 1 and sub.subscribed_count >= 2
                    assert client.last_close is not None and client.last_close.code == 1006
                    assert await client.publish("chat.after-cut", 1) == 0  # requests work on the new connection

    run(main())


def test_a_silent_connection_is_found_by_pings_and_re_made() -> None:
    """A connection that stays open but carries nothing (a dead peer TCP has not noticed): no pong in time,
    the client drops it and resumes on a new one."""
    topic = "feed.frozen"

    async def main() -> None:
        async with gateway() as gw:
            with TcpProxy(gw.http_port) as proxy:
                async with fanout_client.connect(proxy.url, **FAST, ping_interval=0.2, ping_timeout=0.3) as client:
                    sub = await client.subscribe(topic)
                    await publish(gw, topic, [0, 1])
                    assert seqs(await take(sub, 2)) == [0, 1]
                    proxy.freeze()
                    await publish(gw, topic, [2, 3])
                    assert seqs(await take(sub, 2, timeout=8)) == [2, 3]  # over the next connection
                    assert client.reconnects == 1 and client.last_close is not None
                    assert client.last_close.code == 1006  # no close frame came back

    run(main())


def test_a_kick_closes_the_client_for_good() -> None:
    """4000 (an operator's kick): no reconnect; the subscription's queued events come, then its error."""

    async def main() -> None:
        async with gateway() as gw:
            errors: list[FanoutError] = []
            async with fanout_client.connect(gw.http_url, **FAST, on_error=errors.append) as client:
                sub = await client.subscribe("chat.kick")
                await publish(gw, "chat.kick", ["a", "b"])
                await until(lambda: sub.queued == 2, "the messages")
                client_id = (await client.rpc("whoami"))["client_id"]
                await admin(gw, "DELETE", f"/api/clients/{client_id}")
                error = await client.wait_closed()
                assert error is not None and (error.code, error.close_code) == ("closed", 4000)
                assert [e.data for e in await take(sub, 2)] == ["a", "b"]  # type: ignore[union-attr]  # all messages
                with pytest.raises(FanoutError) as ended:
                    await sub.get(1)
                assert ended.value.close_code == 4000
                with pytest.raises(FanoutError) as refused:
                    await client.publish("chat.kick", 1)
                assert refused.value.close_code == 4000
                assert client.reconnects == 0 and errors == [error]

    run(main())


# -- the bound of a subscription's queue ----------------------------------------------------------------------


def test_a_full_queue_pauses_a_ring_topic_and_resumes_it_without_loss() -> None:
    async def main() -> None:
        async with gateway() as gw, fanout_client.connect(gw.http_url, **FAST, max_queued_events=8) as client:
            sub = await client.subscribe("chat.pause")  # capacity 256
            await publish(gw, "chat.pause", list(range(100)))
            await until(lambda: sub.pauses >= 1, "the pause")
            await asyncio.sleep(0.2)
            assert sub.queued <= 8
            assert seqs(await take(sub, 100)) == list(range(100))  # replayed from the gateway's ring
            await nothing_more(sub)
            assert await client.rpc("echo", 1) == 1 and client.reconnects == 0

    run(main())


def test_a_pause_longer_than_the_ring_is_told_as_a_gone_loss() -> None:
    """The `*` rule's rings hold 64 messages: paused at 4 queued, the client misses most of 300, and the
    gateway says exactly which (`gone` when the client resumes): msgs and losses tile [0, 300)."""

    async def main() -> None:
        async with gateway() as gw, fanout_client.connect(gw.http_url, **FAST, max_queued_events=4) as client:
            sub = await client.subscribe("small.ring")
            await publish(gw, "small.ring", list(range(20)))
            await until(lambda: sub.pauses >= 1, "the pause")
            await publish(gw, "small.ring", list(range(20, 300)))  # while paused: most leave the ring
            expected, losses = 0, []
            while expected < 300:
                event = await sub.get(5)
                if isinstance(event, Message):
                    assert event.seq == expected and event.data == expected
                    expected += 1
                else:
                    assert event.from_seq == expected and event.to_seq is not None
                    losses.append(event.reason)
                    expected = event.to_seq
            assert "gone" in losses and set(losses) <= {"gone", "lagged"}
            await nothing_more(sub)

    run(main())


def test_a_full_queue_holds_a_private_topic_back_without_loss() -> None:
    async def main() -> None:
        async with (
            gateway() as gw,
            fanout_client.connect(gw.http_url, token=make_token("alice"), **FAST, max_queued_events=4) as client,
        ):
            sub = await client.subscribe("private.held")
            assert sub.kind == "private"
            await publish(gw, "private.held", [{"n": i} for i in range(40)], client="alice")
            await asyncio.sleep(0.2)
            assert sub.queued <= 4
            assert seqs(await take(sub, 40)) == list(range(40))
            assert sub.pauses == 0 and client.reconnects == 0

    run(main())


@pytest.mark.parametrize("private_ack", [True, False], ids=["ack", "no-ack"])
def test_private_entries_written_to_a_stalled_connection_come_again_with_acks(private_ack: bool) -> None:
    """The chaos run's case: a proxy stalls with a private queue's entries written to it; the client finds
    the connection dead (pings), reconnects and takes its queue over. With acks (the default) the entries
    it never got come again; without, the gateway committed them when written: the client can only tell the
    loss (`gone`)."""

    topic = f"private.stalled-{'ack' if private_ack else 'no-ack'}"  # a queue of its own on the module's gateway

    async def main() -> None:
        async with gateway() as gw:
            with TcpProxy(gw.http_port) as proxy:
                async with fanout_client.connect(
                    proxy.url, token=make_token("alice"), **FAST, ping_interval=0.2, ping_timeout=0.3, private_ack=private_ack
                ) as client:
                    sub = await client.subscribe(topic)
                    await publish(gw, topic, [0, 1], client="alice")
                    assert seqs(await take(sub, 2)) == [0, 1]

                    async def queued() -> int:
                        return int((await admin(gw, "GET", f"/api/topics/{topic}"))["queued"])

                    deadline = time.monotonic() + 5
                    while await queued():  # acknowledged (or written), so gone from the queue
                        assert time.monotonic() < deadline, "the first two were never acknowledged"
                        await asyncio.sleep(0.02)
                    proxy.freeze(hold_open=True)  # the gateway keeps the old connection: the new one takes over
                    await publish(gw, topic, [2, 3], client="alice")
                    events = await take(sub, 2 if private_ack else 1, timeout=8)
                    if private_ack:
                        assert seqs(events) == [2, 3]  # over the next connection, which took the queue over
                    else:
                        assert events == [Loss(topic, 2, 4, "gone", sub.epoch or "")]
                    await nothing_more(sub)
                    assert client.reconnects == 1

    run(main())


# -- tokens and close codes -----------------------------------------------------------------------------------


def test_an_expiring_token_is_refreshed_on_the_live_connection() -> None:
    topic = "chat.token"

    async def main() -> None:
        tokens = [make_token("alice", ttl=2), make_token("alice", ttl=600)]
        asked: list[str] = []

        async def get_token() -> str:
            asked.append(tokens[0])
            return tokens.pop(0)

        async with gateway(auth={"leeway_s": 0, "expired_grace_s": 20}) as gw:
            async with fanout_client.connect(gw.http_url, get_token=get_token, **FAST) as client:
                sub = await client.subscribe(topic)
                assert (await client.rpc("whoami"))["user"] == "alice"
                await until(lambda: client.expires_at is not None, "the refreshed token", timeout=8)
                assert client.user == "alice" and client.expires_at > time.time() + 500  # type: ignore[operator]
                assert len(asked) == 2 and client.token == asked[1]
                await publish(gw, topic, [1])
                assert seqs(await take(sub, 1)) == [0]
                assert client.reconnects == 0

    run(main())


def test_a_token_not_refreshed_in_time_is_closed_4011_and_the_client_reconnects() -> None:
    topic = "chat.token4011"

    async def main() -> None:
        # the refresh gives another user's token (refused), so the gateway closes with 4011; then a good one
        tokens = [make_token("alice", ttl=2), make_token("bob"), make_token("alice")]
        closes: list[int] = []
        errors: list[str] = []
        async with gateway(auth={"leeway_s": 0, "expired_grace_s": 1}) as gw:
            async with fanout_client.connect(
                gw.http_url,
                get_token=lambda: tokens.pop(0),
                **FAST,
                on_state=lambda s, c: c and s == "disconnected" and closes.append(c.code),  # type: ignore[arg-type, func-returns-value]
                on_error=lambda e: errors.append(e.code),
            ) as client:
                sub = await client.subscribe(topic)
                await publish(gw, topic, [0])
                assert seqs(await take(sub, 1)) == [0]
                await until(lambda: client.reconnects >= 1 and client.state == "connected", "the reconnect", 10)
                assert (await client.rpc("whoami"))["user"] == "alice"
                await publish(gw, topic, [1])
                assert seqs(await take(sub, 1)) == [1]
                await nothing_more(sub)
        assert closes == [4011] and errors == ["bad_token"] and tokens == []

    run(main())


def test_a_refused_token_closes_the_client_unless_get_token_gives_another() -> None:
    async def main() -> None:
        async with gateway() as gw:
            # no get_token: 4001 is final, and `async with` says so
            with pytest.raises(FanoutError) as refused:
                async with fanout_client.connect(gw.http_url, token="not-a-jwt", **FAST):
                    pass
            assert (refused.value.code, refused.value.close_code) == ("closed", 4001)
            # get_token gives the same refused token: final too, after one question
            asked: list[int] = []
            with pytest.raises(FanoutError) as refused:

                def same_token() -> str:
                    asked.append(1)
                    return "not-a-jwt"

                async with fanout_client.connect(gw.http_url, token="not-a-jwt", **FAST, get_token=same_token):
                    pass
            assert refused.value.close_code == 4001 and asked == [1]
            # another token: reconnects with it
            async with fanout_client.connect(
                gw.http_url, token="not-a-jwt", get_token=lambda: make_token("carol"), **FAST
            ) as client:
                assert (await client.rpc("whoami"))["user"] == "carol"
                assert client.last_close is not None and client.last_close.code == 4001

    run(main())


def test_an_expired_token_at_connect_is_4011_final_without_get_token() -> None:
    async def main() -> None:
        async with gateway(auth={"leeway_s": 0}) as gw:
            with pytest.raises(FanoutError) as refused:
                async with fanout_client.connect(gw.http_url, token=make_token("dave", ttl=-30), **FAST):
                    pass
            assert (refused.value.code, refused.value.close_code) == ("closed", 4011)
            async with fanout_client.connect(
                gw.http_url, token=make_token("dave", ttl=-30), **FAST, get_token=lambda: make_token("dave")
            ) as client:
                assert (await client.rpc("whoami"))["user"] == "dave"

    run(main())


def test_requests_wait_for_a_connection_and_time_out_when_none_comes() -> None:
    async def main() -> None:
        port = free_port()  # nothing listens there
        options = {**FAST, "request_timeout": 0.5, "start_timeout": None}
        client = fanout_client.connect(f"http://127.0.0.1:{port}", **options, max_pending_requests=2)
        async with client:
            assert client.state in ("connecting", "disconnected")
            waiting = [asyncio.ensure_future(client.rpc("echo", i)) for i in range(2)]
            await asyncio.sleep(0)
            with pytest.raises(FanoutError) as full:
                await client.rpc("echo", 3)
            assert full.value.code == "queue_full"
            for future in waiting:
                with pytest.raises(FanoutError) as late:
                    await future
                assert late.value.code == "timeout"
            with pytest.raises(FanoutError) as late:
                await client.wait_connected(0.2)
            assert late.value.code == "timeout"

    run(main())


# -- the documentation ------------------------------------------------------------------------------------------


def test_the_example_of_docs_client_md_runs_as_written() -> None:
    """The example of "The Python client: fanout_client", run in the checkout against a gateway (its URL in
    place of make run's http://127.0.0.1:8080)."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "client.md").read_text()
    section = doc.split("## The Python client: `fanout_client`", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8080" in example
    with run_gateway() as gw:
        out = subprocess.run(
            [sys.executable, "-c", example.replace("http://127.0.0.1:8080", gw.http_url)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "'transport': 'ws'" in lines[0]
    assert lines[1:4] == ["#0 hello 0", "#1 hello 1", "#2 hello 2"]
    assert lines[4].startswith("resume later with since = Position(epoch=") and lines[4].endswith("seq=3)")
