"""HTTP long-poll transport.

`POST /lp` creates a session; `GET /lp/{session}?ack=N` waits up to the poll timeout for the next batch and
returns `{"batch": id, "entries": [...]}` (entries as on WebSocket); `POST /lp/{session}` sends commands;
`DELETE /lp/{session}` ends it. The session id is a 128-bit secret handed out once: whoever holds it reads
the session, so it is never derived from anything guessable (the client id is a separate, public name).
A waiting poll is what makes the client ready. A batch stays outstanding until
a poll acknowledges its id: only then are its private-queue entries committed (docs/design/private-queues.md §5), and a
poll that does not acknowledge it gets the same batch again, so a lost response loses nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core import Batch, RequestError

from ..edge.http_errors import error_response
from ..errors import BadAck, Closed, UnknownSession
from ..scheduler import Delivered
from ..session import ClientSession, LateRefused, session_store
from ..session_services import SessionServices
from ..session_store import new_secret
from .handshake import http_refusal, late_refusal_response
from .posted import accept_commands, backend_refusal

EMPTY_BODY = b'{"batch":null,"entries":[]}'
UNKNOWN_SESSION = UnknownSession("no such long-poll session (expired or closed)")


class LongPollSession:
    """One long-poll session: a `Connection` of the scheduler (gateway/scheduler.py) whose batches are the
    polls' answers. Made before its client opens (nothing happens until `start`)."""

    def __init__(self, session: ClientSession, secret_prefix: str = "") -> None:
        #: the client's session, which hears of the polls and of the session's end
        self.session = session
        self.identity = session.identity
        self.settings = session.config.longpoll
        self.store = session.store
        #: the session id of the URLs, the only credential a poll carries (`new_secret`)
        self.secret = new_secret(secret_prefix)
        self.poll: asyncio.Future[bytes] | None = None
        #: (batch id, response body) handed out and not yet acknowledged
        self.outstanding: tuple[int, bytes] | None = None
        self.batches = 0
        #: entries (messages, notices, replies) handed to this session: the stats stream's delivery rate
        self.entries_sent = 0
        self._expiry: asyncio.TimerHandle | None = None
        self.closed = False
        #: a poll's answer is a whole body handed over at once: a session is never write-blocked
        self.blocked_since: float | None = None

    def start(self) -> None:
        """The client is open: its secret finds it, and it expires unless polled (not when closed meanwhile)."""
        if not self.closed:
            self.store.longpoll.add(self)
            self.arm_expiry()

    def arm_expiry(self) -> None:
        self.cancel_expiry()
        self._expiry = asyncio.get_running_loop().call_later(self.settings.session_ttl_s, self._expire)

    def cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self.closed = True
        self.store.longpoll.discard(self)
        self.session.gone("expired")

    def deliver(self, batch: Batch, frame: bytes) -> Delivered:
        self.batches += 1
        self.entries_sent += len(batch.entries)
        body = b'{"batch":%d,"entries":%s}' % (self.batches, frame)
        self.outstanding = (self.batches, body)
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(body)
        self.poll = None
        return Delivered.HELD  # done only when a poll acknowledges it

    def flush(self) -> bool:
        return True  # nothing is staged: `deliver` hands the batch to the poll

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        self.closed = True
        self.store.longpoll.discard(self)
        self.cancel_expiry()
        entry: dict[str, Any] = {"type": "error", "code": Closed.code, "message": reason, "close_code": code}
        if retry_ms is not None:  # a drain (1012): the reconnect hint
            entry["retry_ms"] = retry_ms
        body = orjson.dumps({"batch": None, "entries": [entry]})
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(body)
        else:  # closed between two polls: the next one gets it (not 404 unknown_session)
            self.store.closed.keep(self.secret, body)

    def describe(self) -> dict[str, Any]:
        return {
            "transport": "longpoll",
            "peer": self.identity.peer,
            "batches": self.batches,
            "entries_sent": self.entries_sent,
            "polling": self.poll is not None,
        }

    async def wait(self, ack: int | None) -> bytes:
        session = self.session
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(EMPTY_BODY)  # a newer poll supersedes a waiting one
        if self.outstanding is not None:
            if ack != self.outstanding[0]:
                return self.outstanding[1]  # not acknowledged: the same batch again
            self.outstanding = None
            session.acked()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.poll = future
        session.ready()
        try:
            async with asyncio.timeout(self.settings.poll_timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            if future.done():
                return future.result()
            if self.poll is future:
                self.poll = None
                session.idle()
            return EMPTY_BODY


def _session(request: Request) -> LongPollSession | None:
    session = session_store(request.app.state.services).longpoll.get(request.path_params["session"])
    return session if isinstance(session, LongPollSession) else None


async def create_session(request: Request) -> Response:
    """`Authorization: Bearer TOKEN` makes the session its user's (docs/security.md); none: anonymous."""
    services: SessionServices = request.app.state.services
    try:
        session = ClientSession.begin(
            services, "longpoll", request.client, authorization=request.headers.get("authorization", "")
        )
    except RequestError as exc:  # 401 for a refused token, 429 / 503 (retry later) for the others
        return http_refusal(services.config, exc)
    refusal = await backend_refusal(session, request)
    if refusal is not None:
        return refusal
    conn = LongPollSession(session, request.app.state.session_prefix)
    try:
        session.open(conn, ready=False)
    except LateRefused as late:  # revoked, disconnected or draining while the connect hook was awaited
        return late_refusal_response(late.refusal)
    conn.start()
    return JSONResponse({"session": conn.secret, "client_id": session.identity.client_id}, status_code=201)


async def poll(request: Request) -> Response:
    conn = _session(request)
    if conn is None:
        final = session_store(request.app.state.services).closed.take(request.path_params["session"])
        if final is not None:
            return Response(final, media_type="application/json")
        return error_response(UNKNOWN_SESSION)
    ack_text = request.query_params.get("ack")
    try:
        ack = int(ack_text) if ack_text not in (None, "", "null") else None
    except ValueError:
        return error_response(BadAck("`ack` must be an integer batch id"))
    conn.cancel_expiry()
    try:
        body = await conn.wait(ack)
    finally:
        if not conn.closed:
            conn.arm_expiry()
    return Response(body, media_type="application/json")


async def post_commands(request: Request) -> Response:
    conn = _session(request)
    if conn is None:
        return error_response(UNKNOWN_SESSION)
    return await accept_commands(request, conn.session, conn.settings.max_body_bytes)


async def delete_session(request: Request) -> Response:
    conn = _session(request)
    if conn is None:
        return error_response(UNKNOWN_SESSION)
    conn.session.close(1000, "session deleted")
    conn.store.closed.take(conn.secret)  # the client closed it: nothing to tell
    return Response(status_code=204)
