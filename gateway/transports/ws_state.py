"""A WebSocket connection's life (gateway/transports/ws.py) as one state value, and every move it may make.

    HANDSHAKE -> AWAITING_HOOK -> OPEN -> CLOSING -> CLOSED

A handshake with no connect hook to ask goes straight to OPEN; one answered with an HTTP refusal (404, 403,
websockets' 400, 414, 431), or met by the server's shutdown, to CLOSING (a refused session gets the 101 first:
OPEN, then CLOSING); the transport may be lost in any state (CLOSED).

The protocol changes its state only by `WebSocketProtocol.move`, which checks the move against `MOVES`: a
move not in it is our own bug (`IllegalMove`), never the peer's (whose misbehaviour is a close with a code).
"""

from __future__ import annotations

import enum


class WSState(enum.Enum):
    #: the upgrade request is read and checked (path, Origin, `?token=`); nothing is written yet
    HANDSHAKE = "handshake"
    #: the backend's connect hook is asked; the 101 waits for its answer and the peer is not read
    AWAITING_HOOK = "awaiting hook"
    #: the 101 is written: frames go both ways
    OPEN = "open"
    #: our close frame (or the handshake's refusal) is written: no frame goes after it, and what the peer
    #: still sends is dropped until it closes or the grace cuts it
    CLOSING = "closing"
    #: the transport is lost (`connection_lost`): nothing more happens
    CLOSED = "closed"


#: where each state may go; the transport may be lost in any state but the last
MOVES: dict[WSState, frozenset[WSState]] = {
    WSState.HANDSHAKE: frozenset({WSState.AWAITING_HOOK, WSState.OPEN, WSState.CLOSING, WSState.CLOSED}),
    WSState.AWAITING_HOOK: frozenset({WSState.OPEN, WSState.CLOSING, WSState.CLOSED}),
    WSState.OPEN: frozenset({WSState.CLOSING, WSState.CLOSED}),
    WSState.CLOSING: frozenset({WSState.CLOSED}),
    WSState.CLOSED: frozenset(),
}

#: an enum member's lookup costs ~0.1 µs: the paths run per read and per batch compare with these
WS_OPEN, WS_CLOSING = WSState.OPEN, WSState.CLOSING


class IllegalMove(RuntimeError):
    """A move `MOVES` does not allow: our own misuse of the connection, never the peer's doing."""

    def __init__(self, old: WSState, new: WSState) -> None:
        super().__init__(f"a WebSocket connection cannot go from {old.value} to {new.value}")
        self.old = old
        self.new = new


def checked_move(old: WSState, new: WSState) -> WSState:
    """`new`, when `old` may go there; else raises `IllegalMove`."""
    if new not in MOVES[old]:
        raise IllegalMove(old, new)
    return new
