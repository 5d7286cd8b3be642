"""The commands of a `Client` waiting for their answer, by id (fanout_client/client.py): the requests
(publish, rpc; at most ``max_pending_requests``, checked by the client) and the control commands (subscribe,
unsubscribe, auth, the opening ping), at most one per kind and topic whatever the gateway leaves unanswered."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .events import FanoutError

if TYPE_CHECKING:
    from .client import Subscription


@dataclass(slots=True)
class Pending:
    """A command waiting for its answer (by id)."""

    kind: Literal["request", "subscribe", "unsubscribe", "auth", "open"]
    future: asyncio.Future[Any] | None = None
    command: dict[str, Any] | None = None
    sub: Subscription | None = None
    token: str | None = None


class PendingTable:
    """Who waits for which answer: each command's id, the control commands by kind and topic, and the
    requests still waiting for a connection."""

    __slots__ = ("pending", "control", "outbox", "requests", "_next_id")

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}
        #: the id of the control command waiting for its answer, by kind and topic (`new_control`)
        self.control: dict[tuple[str, str], int] = {}
        #: request ids waiting for a connection, in order
        self.outbox: dict[int, None] = {}
        #: requests waiting for an answer or a connection (the client bounds it: ``max_pending_requests``)
        self.requests = 0
        self._next_id = 1

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def new_control(self, pending: Pending, topic: str = "") -> int:
        """The id of a control command (a subscribe, an unsubscribe, an auth, the opening ping), entered in the
        table of commands waiting for an answer. It replaces the one of the same kind and topic still waiting,
        whose late answer is then ignored (``subscribed``, ``unsubscribed``, ``reply``) or reported (``error``):
        whatever the gateway leaves unanswered, the table holds at most one per kind and topic, beside the
        requests."""
        request_id = self.new_id()
        key = (pending.kind, topic)
        older = self.control.get(key)
        if older is not None:
            self.pending.pop(older, None)
        self.control[key] = request_id
        self.pending[request_id] = pending
        return request_id

    def settle(self, request_id: object) -> Pending | None:
        """The command an answer with ``request_id`` is for (None: replaced since, or none of ours)."""
        pending = self.pending.pop(request_id, None) if isinstance(request_id, int) else None
        if pending is not None and pending.kind != "request":
            key = (pending.kind, pending.sub.topic if pending.sub is not None else "")
            if self.control.get(key) == request_id:
                del self.control[key]
        return pending

    def connection_lost(self) -> None:
        """The connection ended: what was sent on it fails with ``disconnected`` (it may have run); the
        requests still waiting for a connection wait on."""
        self.control.clear()  # control commands never wait for a connection: all dropped below
        lost = FanoutError("disconnected", "the connection was lost before the answer (the request may have run)")
        for request_id, pending in list(self.pending.items()):
            if request_id in self.outbox:
                continue  # a request still waiting for a connection: not lost
            del self.pending[request_id]
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(lost)

    def close(self, error: FanoutError) -> None:
        """The client closed: every command still waiting fails with ``error``."""
        for pending in self.pending.values():
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
        self.pending.clear()
        self.control.clear()
        self.outbox.clear()
