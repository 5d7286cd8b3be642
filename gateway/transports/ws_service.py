"""What the WebSocket connections of one server share (`WSService`): the session services, the port's accounting, the
Origin policy, the turn's input budget, the keepalive wheel, the pool of parked frame parsers, the framers;
and what a connection calls of Centrifugo's client protocol (gateway/transports/ws_centrifugo.py builds on
ws.py, so these only name it). Below ws.py and ws_handshake.py, which both read it.
"""

from __future__ import annotations

import logging
from typing import Any
from typing import Protocol as TypingProtocol

from websockets.http11 import Request
from websockets.protocol import OPEN, SERVER, Protocol
from websockets.server import ServerProtocol

from ..edge.netguard import ConnectionLimiter
from ..edge.origin import OriginPolicy
from ..edge.ratelog import BadInputLog
from ..session_services import SessionServices
from .ws_deflate import Framers, inflating_parser, offer_factory
from .ws_keepalive import Keepalive
from .ws_turns import InputTurn

#: websockets' own log: it logs each connection's opening at INFO, one line per client
FRAMES_LOG = logging.getLogger("gateway.ws.protocol")
FRAMES_LOG.setLevel(logging.WARNING)

#: parked frame parsers a server keeps for the next reads (`ParserPool`)
PARSER_POOL = 64


class CentrifugoLink(TypingProtocol):
    """A connection of Centrifugo's client protocol (gateway/transports/ws_centrifugo.py)."""

    def received(self, payload: bytes, text: bool) -> None:
        """One message: its commands are queued, run one a step by `step` (ws.py `_handle_input`)."""

    @property
    def busy(self) -> bool:
        """Commands of its frames wait: for their steps, or for the connect hook (`waiting`)."""

    @property
    def waiting(self) -> bool:
        """The connect hook is asked: nothing runs, nothing is read, until the link calls `resume_input`."""

    def step(self) -> None: ...

    def lost(self) -> None: ...


class CentrifugoEndpoint(TypingProtocol):
    """Centrifugo's client protocol at its path (gateway/transports/ws_centrifugo.py)."""

    @property
    def path(self) -> str: ...

    def handshake(self, max_size: int, logger: Any) -> ServerProtocol: ...

    def codec_name(self, subprotocol: str | None, query: str) -> str: ...

    # `proto` is ws.py's `WebSocketProtocol`, which imports this module
    def link(self, proto: Any, request: Request, codec_name: str) -> CentrifugoLink: ...


class ParserPool:
    """Frame parsers (websockets `Protocol`, state OPEN) at a frame boundary, no message begun, kept for the
    next connection with input: one per connection while it reads, none while it is idle. Two kinds: plain,
    and inflating for the connections that negotiated permessage-deflate (ws_deflate.py)."""

    __slots__ = ("max_message_bytes", "free", "free_inflating")

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.free: list[Protocol] = []
        self.free_inflating: list[Protocol] = []

    def take(self, inflating: bool) -> Protocol:
        free = self.free_inflating if inflating else self.free
        if free:
            return free.pop()
        if inflating:
            return inflating_parser(self.max_message_bytes, FRAMES_LOG)
        return Protocol(SERVER, state=OPEN, max_size=self.max_message_bytes, logger=FRAMES_LOG)

    def give_back(self, parser: Protocol, inflating: bool) -> None:
        free = self.free_inflating if inflating else self.free
        if len(free) < PARSER_POOL:
            free.append(parser)


class WSService:
    """What the WebSocket connections of one server share: the session services, the HTTP port's connection accounting
    (an upgraded connection holds its slot until it is lost), the Origin policy, the turn's input budget,
    the keepalive wheel and the parser pool."""

    def __init__(
        self, services: SessionServices, limiter: ConnectionLimiter, origins: OriginPolicy, bad_input: BadInputLog
    ) -> None:
        self.services = services
        self.config = services.config.websocket
        self.limiter = limiter
        self.origins = origins
        #: where a peer's protocol errors are counted, and logged at a bounded rate
        self.bad_input = bad_input
        self.turn = InputTurn()
        self.keepalive = Keepalive(self.config.ping_interval_s, self.config.ping_timeout_s)
        self.parsers = ParserPool(self.config.max_frame_bytes)
        #: permessage-deflate as offered to handshakes (none: declined), and the frames' framers
        self.extensions = [offer_factory()] if self.config.compression == "deflate" else None
        self.framers = Framers(self.config.compression_min_bytes)
        #: the server's open connections (uvicorn's, which its shutdown closes and waits for)
        self.connections: set[Any] | None = None
        #: Centrifugo's client protocol at `centrifugo.path` (gateway/transports/ws_centrifugo.py), when enabled
        self.centrifugo: CentrifugoEndpoint | None = None
