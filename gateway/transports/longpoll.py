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

from ..bodies import read_body
from ..commands import handle_payload
from ..errors import BadAck, BadJson, Closed, UnknownSession
from ..http_errors import error_response
from ..hub import Hub
from ..identity import ClientIdentity
from .handshake import admit, http_backend_refusal, http_refusal, late_refusal_response
from .sessions import new_secret

EMPTY_BODY = b'{"batch":null,"entries":[]}'
UNKNOWN_SESSION = UnknownSession("no such long-poll session (expired or closed)")


class LongPollSession:
    def __init__(self, hub: Hub, identity: ClientIdentity, secret_prefix: str = "") -> None:
        self.hub = hub
        self.identity = identity
        #: the session id of the URLs, the only credential a poll carries (`new_secret`)
        self.secret = new_secret(secret_prefix)
        hub.sessions.longpoll.add(self)
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
        self.arm_expiry()

    def arm_expiry(self) -> None:
        self.cancel_expiry()
        ttl = self.hub.config.longpoll.session_ttl_s
        self._expiry = asyncio.get_running_loop().call_later(ttl, self._expire)

    def cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self.closed = True
        self.hub.sessions.longpoll.discard(self)
        self.hub.clients.unregister(self.identity.client_id, "expired")

    def deliver(self, batch: Batch, frame: bytes) -> bool:
        self.batches += 1
        self.entries_sent += len(batch.entries)
        body = b'{"batch":%d,"entries":%s}' % (self.batches, frame)
        self.outstanding = (self.batches, body)
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(body)
        self.poll = None
        return False  # done only when a poll acknowledges it

    def flush(self) -> bool:
        return True  # nothing is staged: `deliver` hands the batch to the poll

    def direct_fd(self, batch: Batch, frame: bytes) -> int:
        return -1  # a poll's response carries it

    def wire(self, frame: bytes) -> bytes:
        raise NotImplementedError

    def write_rest(self, data: bytes, sent: int) -> bool:
        raise NotImplementedError

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        self.closed = True
        self.hub.sessions.longpoll.discard(self)
        self.cancel_expiry()
        entry: dict[str, Any] = {"type": "error", "code": Closed.code, "message": reason, "close_code": code}
        if retry_ms is not None:  # a drain (1012): the reconnect hint
            entry["retry_ms"] = retry_ms
        body = orjson.dumps({"batch": None, "entries": [entry]})
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(body)
        else:  # closed between two polls: the next one gets it (not 404 unknown_session)
            self.hub.sessions.closed.keep(self.secret, body)

    def describe(self) -> dict[str, Any]:
        return {"transport": "longpoll", "peer": self.identity.peer, "batches": self.batches, "entries_sent": self.entries_sent,
                "polling": self.poll is not None}

    async def wait(self, ack: int | None) -> bytes:
        hub = self.hub
        cid = self.identity.client_id
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(EMPTY_BODY)  # a newer poll supersedes a waiting one
        if self.outstanding is not None:
            if ack != self.outstanding[0]:
                return self.outstanding[1]  # not acknowledged: the same batch again
            self.outstanding = None
            hub.scheduler.commit(cid)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.poll = future
        hub.scheduler.mark_ready(cid)
        try:
            return await asyncio.wait_for(asyncio.shield(future), hub.config.longpoll.poll_timeout_s)
        except asyncio.TimeoutError:
            if future.done():
                return future.result()
            if self.poll is future:
                self.poll = None
                if cid in hub.clients.conns:
                    hub.scheduler.mark_idle(cid)
            return EMPTY_BODY


def _session(request: Request) -> LongPollSession | None:
    hub: Hub = request.app.state.hub
    session = hub.sessions.longpoll.get(request.path_params["session"])
    return session if isinstance(session, LongPollSession) else None


async def create_session(request: Request) -> Response:
    """`Authorization: Bearer TOKEN` makes the session its user's (docs/security.md); none: anonymous."""
    hub: Hub = request.app.state.hub
    try:
        admission = admit(hub, "longpoll", request.client, authorization=request.headers.get("authorization", ""))
    except RequestError as exc:  # 401 for a refused token, 429 / 503 (retry later) for the others
        return http_refusal(hub, exc)
    refusal = await http_backend_refusal(admission, request)
    if refusal is not None:
        return refusal
    late = admission.settle()
    if late is not None:  # revoked, disconnected or draining while the connect hook was awaited
        return late_refusal_response(late)
    session = LongPollSession(hub, admission.identity, request.app.state.session_prefix)
    hub.clients.register(session, ready=False)
    return JSONResponse({"session": session.secret, "client_id": admission.identity.client_id}, status_code=201)


async def poll(request: Request) -> Response:
    session = _session(request)
    if session is None:
        final = request.app.state.hub.sessions.closed.take(request.path_params["session"])
        if final is not None:
            return Response(final, media_type="application/json")
        return error_response(UNKNOWN_SESSION)
    ack_text = request.query_params.get("ack")
    try:
        ack = int(ack_text) if ack_text not in (None, "", "null") else None
    except ValueError:
        return error_response(BadAck("`ack` must be an integer batch id"))
    session.cancel_expiry()
    try:
        body = await session.wait(ack)
    finally:
        if not session.closed:
            session.arm_expiry()
    return Response(body, media_type="application/json")


async def post_commands(request: Request) -> Response:
    session = _session(request)
    if session is None:
        return error_response(UNKNOWN_SESSION)
    hub: Hub = request.app.state.hub
    return await accept_commands(request, hub, session.identity.client_id, hub.config.longpoll.max_body_bytes)


async def accept_commands(request: Request, hub: Hub, client_id: str, max_body_bytes: int) -> Response:
    """A POSTed command or array of commands, run for `client_id` (long-poll, SSE): `202 {"accepted": n}`,
    the answers on the client's stream; a body that is too large or not JSON is a 4xx JSON error."""
    try:
        body = await read_body(request, max_body_bytes)
    except RequestError as exc:
        return error_response(exc)
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return error_response(BadJson(f"not JSON: {exc}"))
    count = handle_payload(hub, client_id, body)
    return JSONResponse({"accepted": count}, status_code=202)


async def delete_session(request: Request) -> Response:
    session = _session(request)
    if session is None:
        return error_response(UNKNOWN_SESSION)
    session.kick(1000, "session deleted")
    request.app.state.hub.sessions.closed.take(session.secret)  # the client closed it: nothing to tell
    request.app.state.hub.clients.unregister(session.identity.client_id, "closed")
    return Response(status_code=204)
