"""How much of a turn of the event loop WebSocket input may take.

Parsing a connection's frames and running its commands takes CPU time: one connection's input may take
`TURN_BUDGET_S` of a turn, all the connections' input together `TURN_BUDGET_ALL_S` (`InputTurn`); what is
left waits for the next turn, the connection not read meanwhile (TCP back-pressure). Without it, a burst of
commands (8 connections, each read holding 5 frames of 60 `auth`) took ~25 ms per turn and /healthz of
another client waited 64-84 ms at p99. A step (a slice of `PARSE_SLICE` bytes parsed, one message's commands
run, ~0.2 ms for 100 cheap ones) is never cut, and each connection with input takes at least one step per
turn, so none waits behind the others for long.
"""

from __future__ import annotations

import asyncio

TURN_BUDGET_S = 0.00025
TURN_BUDGET_ALL_S = 0.001
#: bytes handed to the frame parser at a time: a peer's protocol error (too many fragments) is seen after at
#: most this much of a read, and a slice of the smallest frames (2,700 pings in 16 KiB: ~7 ms) takes ~2 ms
PARSE_SLICE = 4096


class InputTurn:
    """The time the WebSocket connections of one server may spend on their input in one turn of the event
    loop together; the turn is over when the callback it schedules runs (the next turn), as the ingest's
    `LoopTurn` (gateway/transports/ingest.py)."""

    __slots__ = ("budget", "deadline")

    def __init__(self, budget: float = TURN_BUDGET_ALL_S) -> None:
        self.budget = budget
        #: when this turn's budget is spent; None: no input was handled yet in this turn
        self.deadline: float | None = None

    def until(self, now: float) -> float:
        deadline = self.deadline
        if deadline is None:
            deadline = self.deadline = now + self.budget
            asyncio.get_running_loop().call_soon(self._next_turn)
        return deadline

    def _next_turn(self) -> None:
        self.deadline = None
