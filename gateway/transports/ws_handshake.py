"""The HTTP upgrade of a WebSocket connection (gateway/transports/ws.py), from the request's bytes to the 101 or
the refusal: the path (`/ws`, or Centrifugo's `centrifugo.path`), `websocket.enabled`, the Origin, the session
of `?token=` and `?id=` (gateway/session.py), the backend's connect hook, then the 101 and the registration.

websockets' `ServerProtocol` parses the request and writes the answer; this module decides it. A refusal
before the upgrade is an HTTP answer (404, 403 with our JSON error body; websockets' own 400, 414, 431) and
a close; a refusal of the session is the 101 and at once a close frame with its code. The `Handshake` lives
only while the connection upgrades: an open connection holds none.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from typing import Protocol as TypingProtocol
from urllib.parse import parse_qs

import orjson
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol

from core import RequestError

from ..errors import Forbidden, NotFound
from ..session import ClientSession
from .handshake import close_reason
from .streams import KICK_GRACE_S
from .ws_deflate import negotiated_window
from .ws_service import FRAMES_LOG, CentrifugoEndpoint, CentrifugoLink, WSService
from .ws_state import WSState

if TYPE_CHECKING:
    from ..session_services import SessionServices

__all__ = ["WS_PATH", "Handshake", "Upgrading", "begin_ws_session"]

#: the route `/ws` connections take; any other path of an upgrade request is answered 404
WS_PATH = "/ws"


def json_refusal(server: ServerProtocol, status: int, error: RequestError) -> Response:
    """A refused handshake's answer with our JSON error body (websockets' `reject` gives plain text)."""
    response = server.reject(status, "")
    body = orjson.dumps({"error": {"code": error.code, "message": error.message}})
    headers = Headers([(k, v) for k, v in response.headers.raw_items() if k.lower() not in ("content-type", "content-length")])
    headers["Content-Type"] = "application/json"
    headers["Content-Length"] = str(len(body))
    return Response(response.status_code, response.reason_phrase, headers, body)


def begin_ws_session(services: SessionServices, query: str, peer: tuple[str, int] | None) -> ClientSession:
    """The session of a `/ws` handshake (its query string, `?token=`, `?id=`): gateway/session.py. Raises the
    refusal (`RequestError`), whose `close_code` and `close_reason` are the close frame the peer gets."""
    params = parse_qs(query, keep_blank_values=True)
    tokens, ids = params.get("token"), params.get("id")
    return ClientSession.begin(services, "ws", peer, token=tokens[-1] if tokens else None, requested_id=ids[-1] if ids else None)


class Upgrading(TypingProtocol):
    """What the handshake needs of its connection (gateway/transports/ws.py `WebSocketProtocol`)."""

    service: WSService
    transport: asyncio.Transport
    peer: tuple[str, int] | None
    #: the connection's state: the handshake moves it by `move` only (ws_state.py)
    state: WSState
    #: the handshake itself while the connection upgrades, None from its answer on
    handshake: Handshake | None
    #: permessage-deflate's window of the connection's frames, 0 when not negotiated
    window_bits: int
    centrifugo: CentrifugoLink | None

    def move(self, new: WSState) -> None: ...

    def open_session(self, session: ClientSession) -> None:
        """Upgraded: start the keepalive and register the session."""

    def close_with(self, code: int, reason: str) -> None: ...

    def linger_close(self, grace: float) -> None: ...


class Handshake:
    """One connection's upgrade (module docstring): made with the protocol, dropped once it is answered."""

    __slots__ = ("proto", "server")

    def __init__(self, proto: Upgrading) -> None:
        self.proto = proto
        config = proto.service.config
        #: websockets' handshake: it parses the request and serializes the answer
        self.server = ServerProtocol(extensions=proto.service.extensions, max_size=config.max_frame_bytes, logger=FRAMES_LOG)

    def received(self, data: bytes) -> None:
        """Bytes of the request. uvicorn hands over the request's bytes alone (and the peer is not read while
        the connect hook is asked), so the request is the only event; it is answered in this step, or after
        the hook."""
        server = self.server
        server.receive_data(data)
        events = server.events_received()
        if not events and server.handshake_exc is not None:
            self._refused_by_websockets()
            return
        for event in events:
            if isinstance(event, Request) and self.proto.state is WSState.HANDSHAKE:
                self._request(event)

    def _request(self, request: Request) -> None:
        proto = self.proto
        service = proto.service
        server = self.server
        path, _, query = request.path.partition("?")
        centrifugo = service.centrifugo
        if path != WS_PATH and (centrifugo is None or path != centrifugo.path):
            self._answer_and_close(
                server,
                json_refusal(server, 404, NotFound(f"no WebSocket endpoint at {path[:100]!r}: the WebSocket is at {WS_PATH}")),
            )
            return
        if not service.config.enabled:
            self._answer_and_close(
                server, json_refusal(server, 403, Forbidden("the WebSocket transport is disabled (websocket.enabled)"))
            )
            return
        origin = request.headers.get("Origin")
        if origin is not None and not service.origins.allows(origin, request.headers.get("Host")):
            service.bad_input("ws", "origin %r refused (server.allowed_origins)", origin[:100])
            self._answer_and_close(server, json_refusal(server, 403, Forbidden("origin not allowed (server.allowed_origins)")))
            return
        if path != WS_PATH:
            assert centrifugo is not None
            self._open_centrifugo(centrifugo, request, query)
            return
        response = server.accept(request)
        if response.status_code != 101:  # not a valid upgrade: websockets says why
            self._answer_and_close(server, response)
            return
        try:
            session = begin_ws_session(service.services, query, proto.peer)
        except RequestError as exc:
            self._upgrade(server, response)
            assert exc.close_code is not None  # every refusal of the handshake ends a WebSocket with a code
            proto.close_with(exc.close_code, close_reason(exc))
            return
        if session.awaits_hook:
            # the 101 waits for the backend's connect hook; the peer is not read meanwhile
            proto.move(WSState.AWAITING_HOOK)
            proto.transport.pause_reading()
            session.spawn(self._ask_hook(session, request, response))
            return
        self._upgrade(server, response)
        proto.open_session(session)

    async def _ask_hook(self, session: ClientSession, request: Request, response: Response) -> None:
        """The connect hook (gateway/hooks/base.py), then the 101 and the registration; a refusal is the 101 and
        at once a close with 4003 (the backend's message as the reason), no answer 1013 "backend unavailable"."""
        refusal: RequestError | None = None
        try:
            await session.pass_backend(request.headers.get_all)
        except RequestError as exc:
            refusal = exc
        proto = self.proto
        if proto.state is not WSState.AWAITING_HOOK or proto.transport.is_closing():
            session.gone()
            return  # the peer left while the backend was asked, or the server shuts down
        proto.transport.resume_reading()
        self._upgrade(self.server, response)
        if refusal is not None:
            assert refusal.close_code is not None
            proto.close_with(refusal.close_code, close_reason(refusal))
            return
        proto.open_session(session)

    def _open_centrifugo(self, endpoint: CentrifugoEndpoint, request: Request, query: str) -> None:
        """A Centrifugo connection: the 101 with the SDK's subprotocol (and permessage-deflate as on `/ws`),
        and no session until its `connect` command (gateway/transports/ws_centrifugo.py); its pings are
        Centrifugo's, not ours. The link is made once upgraded: its frames depend on the negotiated window."""
        proto = self.proto
        server = endpoint.handshake(proto.service.config.max_frame_bytes, FRAMES_LOG)
        response = server.accept(request)
        if response.status_code != 101:
            self._answer_and_close(server, response)
            return
        self._upgrade(server, response)
        proto.centrifugo = endpoint.link(proto, request, endpoint.codec_name(server.subprotocol, query))

    def _upgrade(self, server: ServerProtocol, response: Response) -> None:
        """Write the 101: the connection is a WebSocket from here on; the handshake is done."""
        proto = self.proto
        server.send_response(response)
        proto.transport.write(b"".join(server.data_to_send()))
        proto.window_bits = negotiated_window(server.extensions) if response.status_code == 101 else 0
        proto.handshake = None
        proto.move(WSState.OPEN)

    def _answer_and_close(self, server: ServerProtocol, response: Response) -> None:
        proto = self.proto
        proto.move(WSState.CLOSING)
        proto.handshake = None
        server.send_response(response)
        proto.transport.write(b"".join(server.data_to_send()))
        proto.transport.close()

    def _refused_by_websockets(self) -> None:
        """websockets refused the request itself (a line over 8 KiB, over 128 headers, not HTTP): it queued
        its answer (414, 431; nothing for a non-HTTP request) but gives no event. Answer and close."""
        proto = self.proto
        proto.handshake = None
        proto.service.limiter.refuse("header_too_large", proto.peer[0] if proto.peer else "")
        proto.transport.write(b"".join(self.server.data_to_send()))
        proto.linger_close(KICK_GRACE_S)
