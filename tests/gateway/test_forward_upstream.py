"""The worker forwarder (gateway/workers/forward.py, docs/cluster.md §5) against a fake owner: the test holds
worker 1's inbox, takes each connection passed to it, reads the request with h11 (a server's parser) and
answers whatever bytes a case needs, well-formed or not. In one process, no Redis, no gateway: what the
forwarder writes, what it relays, and how it answers an owner that misbehaves (documented: `500
internal_error` while nothing was sent, else the response ended short)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11
import orjson
import pytest

from gateway.config import load_config
from gateway.workers import forward
from gateway.workers.forward import KEY_HEADER, SessionRouter, WorkerLinks, make_inbox

KEY = "the-cluster-key-0123456789"
#: the owner's part in one case: (its end of the connection, the request it read) -> None
Owner = Callable[[socket.socket, "Received"], Awaitable[None]]


@dataclass
class Received:
    """What the fake owner read: the request as h11 parsed it, and its body."""

    request: h11.Request
    body: bytes

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return list(self.request.headers)


@dataclass
class Outcome:
    """What the client got from the router: ASGI messages, and the time each came (monotonic)."""

    messages: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    received: Received | None = None
    #: the owner saw the end of its connection (the forwarder closed it)
    upstream_closed: bool = False

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    @property
    def ended(self) -> bool:
        return (
            bool(self.messages)
            and self.messages[-1]["type"] == "http.response.body"
            and not self.messages[-1].get("more_body", False)
        )

    def error(self) -> dict:
        assert self.headers[b"content-type"] == b"application/json"
        return orjson.loads(self.body)["error"]


async def _accept(inbox: socket.socket, timeout: float = 5.0) -> socket.socket:
    """The next connection passed to the inbox (as serve_inbox takes it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _data, fds, _flags, _addr = socket.recv_fds(inbox, 1, 1)
        except BlockingIOError:
            assert time.monotonic() < deadline, "no connection was passed to the owner"
            await asyncio.sleep(0.002)
            continue
        conn = socket.socket(fileno=fds[0])
        conn.setblocking(False)
        return conn


async def _read_request(conn: socket.socket) -> Received:
    """The request on `conn`, parsed by h11 as a server: what the forwarder wrote is valid HTTP/1.1."""
    loop = asyncio.get_running_loop()
    parser = h11.Connection(h11.SERVER)
    request: h11.Request | None = None
    body = b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(await loop.sock_recv(conn, 65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return Received(request, body)
        else:
            raise AssertionError(f"unexpected {event!r}")


async def _eof(conn: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the peer closes `conn` within `timeout` (what it still sends is dropped)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while await loop.sock_recv(conn, 65536):
                pass
    except (TimeoutError, ConnectionResetError):
        return False
    return True


def answer(*pieces: bytes | float, close: bool = True) -> Owner:
    """An owner that writes `pieces` in order (a float: sleep that long), then closes (or stays open)."""

    async def owner(conn: socket.socket, _received: Received) -> None:
        loop = asyncio.get_running_loop()
        for piece in pieces:
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            else:
                await loop.sock_sendall(conn, piece)
        if not close:
            await asyncio.sleep(3600)

    return owner


def scope_of(
    method: str = "GET",
    path: str = "/lp/w1.secret",
    query: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    client: tuple[str, int] = ("203.0.113.7", 5555),
) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(b"host", b"gw.example:8080")] if headers is None else headers,
        "client": client,
        "server": ("127.0.0.1", 8080),
    }


def router(**overrides: object) -> tuple[SessionRouter, socket.socket, socket.socket]:
    """A router of worker 0 whose worker 1 is the test: (router, worker 1's inbox, its sending end)."""
    receiving, sending = make_inbox()
    links = WorkerLinks(0, (None, sending), receiving, KEY)

    async def app(scope, receive, send) -> None:
        raise AssertionError(f"served locally: {scope['path']}")

    config = load_config(overrides={"longpoll": {"poll_timeout_s": 1.0}, **overrides}, environ={})
    return SessionRouter(app, links, config), receiving, sending


async def run_forward(
    owner: Owner | None,
    scope: dict | None = None,
    body: bytes = b"",
    leave_after: float | None = None,
    route: SessionRouter | None = None,
    inbox: socket.socket | None = None,
) -> Outcome:
    """One request through a router to `owner` (None: nobody takes the connection). `leave_after`: the
    client goes away after that many seconds."""
    outcome = Outcome()
    if route is None:
        route, inbox, _sending = router()
    assert inbox is not None
    left = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if leave_after is None:
            await asyncio.Event().wait()  # the client stays (the router cancels this wait when done)
        await asyncio.sleep(leave_after)  # type: ignore[arg-type]  # not None past the check above
        left.set()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        outcome.messages.append(message)
        outcome.times.append(time.monotonic())

    async def play_owner() -> None:
        if owner is None:
            return
        conn = await _accept(inbox)
        try:
            outcome.received = await _read_request(conn)
            playing = asyncio.ensure_future(owner(conn, outcome.received))
            closed = asyncio.ensure_future(_eof(conn, 30.0))
            await asyncio.wait((playing, closed), return_when=asyncio.FIRST_COMPLETED)
            if closed.done():
                outcome.upstream_closed = closed.result()
            playing.cancel()
            closed.cancel()
            await asyncio.gather(playing, closed, return_exceptions=True)
        finally:
            conn.close()

    owner_task = asyncio.ensure_future(play_owner())
    await route(scope or scope_of(), receive, send)  # type: ignore[arg-type]
    await asyncio.wait_for(owner_task, 10)
    return outcome


def run(coro: Awaitable[Outcome]) -> Outcome:
    return asyncio.run(coro)  # type: ignore[arg-type]


OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


# -- the request the owner gets ----------------------------------------------------------------------------


def test_the_owner_gets_method_target_headers_body_the_client_address_and_the_key():
    headers = [
        (b"host", b"gw.example:8080"),
        (b"authorization", b"Bearer t  "),
        (b"origin", b"https://a.example"),
        (b"content-type", b"application/json"),
        (b"content-length", b"14"),
        (b"connection", b"keep-alive"),
        (b"keep-alive", b"timeout=5"),
        (b"te", b"trailers"),
        (b"expect", b"100-continue"),
        (b"x-forwarded-for", b"6.6.6.6"),
        (KEY_HEADER, b"forged"),
        (b"x-obs", b"caf\xe9\tau lait"),
    ]
    got = run(run_forward(answer(OK_JSON), scope_of("POST", query=b"ack=3&x={|}", headers=headers), body=b'{"op": "ping"}'))
    assert got.status == 200 and got.body == b"{}" and got.ended
    received = got.received
    assert received is not None
    assert (received.request.method, received.request.target) == (b"POST", b"/lp/w1.secret?ack=3&x={|}")
    assert received.body == b'{"op": "ping"}'
    assert received.headers == [
        (b"host", b"gw.example:8080"),
        (b"authorization", b"Bearer t"),
        (b"origin", b"https://a.example"),
        (b"content-type", b"application/json"),
        (b"x-obs", b"caf\xe9\tau lait"),
        (b"x-forwarded-for", b"203.0.113.7"),
        (KEY_HEADER, KEY.encode()),
        (b"content-length", b"14"),
        (b"connection", b"close"),
    ]


def test_a_request_without_host_is_forwarded_with_an_empty_one():
    got = run(run_forward(answer(OK_JSON), scope_of("DELETE", headers=[(b"user-agent", b"svc/1")])))
    assert got.status == 200 and got.received is not None
    assert got.received.request.method == b"DELETE"
    assert (b"host", b"") in got.received.headers and (b"content-length", b"0") in got.received.headers


def test_a_request_h11_will_not_write_is_a_400_and_reaches_no_worker():
    route, inbox, _sending = router()
    two_hosts = [(b"host", b"a.example"), (b"host", b"b.example")]
    got = run(run_forward(None, scope_of(headers=two_hosts), route=route, inbox=inbox))
    assert got.status == 400 and got.error()["code"] == "bad_request"
    assert "forwarded" in got.error()["message"]
    with pytest.raises(BlockingIOError):
        socket.recv_fds(inbox, 1, 1)


# -- what the client gets back --------------------------------------------------------------------------


def test_a_response_is_relayed_without_hop_by_hop_or_cors_headers():
    head = (
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nx-custom: v\r\nretry-after: 1\r\n"
        b"connection: close\r\nkeep-alive: timeout=5\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\n"
        b"vary: Origin\r\naccess-control-allow-origin: https://a.example\r\n"
        b"access-control-expose-headers: Retry-After\r\ncontent-length: 11\r\n\r\n"
    )
    got = run(run_forward(answer(head + b'{"a": true}')))
    assert got.status == 201 and got.body == b'{"a": true}' and got.ended
    assert got.messages[0]["headers"] == [
        (b"content-type", b"application/json"),
        (b"x-custom", b"v"),
        (b"retry-after", b"1"),
        (b"content-length", b"11"),
    ]


def test_a_chunked_body_streams_through_piece_by_piece_and_loses_its_framing():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n"
    got = run(run_forward(answer(head, b"6\r\nfirst\n\r\n", 0.4, b"7\r\nsecond\n\r\n0\r\nx-trailer: t\r\n\r\n")))
    assert got.status == 200 and got.ended
    assert got.headers == {b"content-type": b"text/event-stream"}  # no framing: uvicorn chunks it anew
    assert got.body == b"first\nsecond\n"
    pieces = [(m["body"], t) for m, t in zip(got.messages[1:], got.times[1:]) if m["body"]]
    assert [p for p, _ in pieces] == [b"first\n", b"second\n"]
    assert pieces[1][1] - pieces[0][1] >= 0.3  # the first was passed on before the second was written


def test_a_content_length_body_streams_and_a_close_delimited_one_ends_with_the_connection():
    got = run(run_forward(answer(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nabc", 0.4, b"def")))
    assert got.status == 200 and got.body == b"abcdef" and got.ended
    assert got.times[-1] - got.times[1] >= 0.3
    got = run(run_forward(answer(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil ", 0.1, b"the end")))
    assert got.status == 200 and got.body == b"until the end" and got.ended
    assert b"content-length" not in got.headers


def test_interim_responses_are_skipped_and_bodiless_statuses_end_at_once():
    got = run(run_forward(answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", close=False)))
    assert got.status == 204 and got.body == b"" and got.ended
    assert got.upstream_closed  # done: the forwarder closed its end, though the owner kept it open


# -- an owner that misbehaves -----------------------------------------------------------------------------

MALFORMED = [
    b"",  # closed without a word
    b"garbage\r\n\r\n",
    b"HTTP/2.0 200 OK\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\n\r\n",
    b"HTTP/1.1 099 Low\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad\x00name: v\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain",  # head cut off
]


@pytest.mark.parametrize("response", MALFORMED)
def test_a_malformed_response_head_is_answered_500_internal_error(response):
    got = run(run_forward(answer(response)))
    assert got.status == 500 and got.ended
    error = got.error()
    assert error["code"] == "internal_error"
    assert error["message"].startswith("the worker holding this session did not answer (")


def test_a_head_over_the_bound_is_refused_even_when_it_comes_in_one_piece():
    padding = b"x-pad: " + b"p" * (forward.MAX_HEAD_BYTES + 100) + b"\r\n"
    got = run(run_forward(answer(b"HTTP/1.1 200 OK\r\n" + padding + b"content-length: 0\r\n\r\n")))
    assert got.status == 500 and got.error()["code"] == "internal_error"
    assert "RemoteProtocolError" in got.error()["message"]
    under = b"x-pad: " + b"p" * (forward.MAX_HEAD_BYTES - 200) + b"\r\n"
    got = run(run_forward(answer(b"HTTP/1.1 200 OK\r\n" + under + b"content-length: 2\r\n\r\nok")))
    assert got.status == 200 and got.body == b"ok"


@pytest.mark.parametrize(
    "rest",
    [
        b"content-length: 10\r\n\r\nshort",  # the owner closes before its length
        b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",  # before the last chunk
        b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",  # a chunk size that is no number
    ],
)
def test_a_body_cut_short_ends_the_started_response_short(rest):
    got = run(run_forward(answer(b"HTTP/1.1 200 OK\r\n" + rest)))
    assert got.status == 200 and got.ended  # the head was sent: no second answer, the body just ends
    assert got.body in (b"short", b"hello")


def test_an_owner_that_never_answers_times_out_as_500(monkeypatch):
    monkeypatch.setattr(forward, "RESPONSE_TIMEOUT_S", 0.3)
    start = time.monotonic()
    got = run(run_forward(answer(close=False), scope_of("POST")))
    assert 0.25 <= time.monotonic() - start < 5
    assert got.status == 500 and "TimeoutError" in got.error()["message"]
    assert got.upstream_closed


def test_a_long_poll_gets_its_poll_timeout_on_top_of_the_answer_bound(monkeypatch):
    monkeypatch.setattr(forward, "RESPONSE_TIMEOUT_S", 0.3)  # poll_timeout_s is 1.0 here
    got = run(run_forward(answer(0.8, OK_JSON), scope_of("GET")))
    assert got.status == 200 and got.body == b"{}"


def test_a_body_that_stalls_ends_the_response_short(monkeypatch):
    monkeypatch.setattr(forward, "RESPONSE_TIMEOUT_S", 0.3)
    got = run(run_forward(answer(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", close=False), scope_of("POST")))
    assert got.status == 200 and got.body == b"abc" and got.ended and got.upstream_closed


def test_an_owner_that_is_gone_is_a_500_at_once():
    route, inbox, _sending = router()
    inbox.close()  # the owner's end of its inbox: as when the worker died
    start = time.monotonic()
    got = run(run_forward(None, route=route, inbox=inbox))
    assert time.monotonic() - start < 1
    assert got.status == 500 and got.error()["code"] == "internal_error"


def test_a_client_that_leaves_closes_the_upstream_at_once():
    start = time.monotonic()
    got = run(run_forward(answer(close=False), scope_of("GET"), leave_after=0.3))
    assert got.upstream_closed and time.monotonic() - start < 3
    assert got.messages == []  # nothing is answered to a client that is gone


def test_forwards_beyond_the_bound_get_503_with_retry_after():
    route, inbox, _sending = router(server={"max_connections": 2})
    route.active = 2  # two forwards under way
    got = run(run_forward(None, route=route, inbox=inbox))
    assert got.status == 503 and got.error()["code"] == "too_many_connections"
    assert got.headers[b"retry-after"] == b"1"
    route.active = 1
    got = run(run_forward(answer(OK_JSON), route=route, inbox=inbox))
    assert got.status == 200 and route.active == 1
