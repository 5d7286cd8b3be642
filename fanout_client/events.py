"""What a subscription yields, and the sans-I/O recovery logic behind it (docs/client.md, "The Python client").

`Message` and `Loss` are the two events of a subscription's stream, in order; for each topic their seqs
tile the seq line (docs/protocol.md, "Loss and recovery semantics"). `Stream` turns the gateway's entries
of one topic (`subscribed`, `msg`, `loss`) into those events, exactly as static/fanout.js does: it keeps the
epoch and the next seq needed, drops redeliveries, reports an unannounced hole as a `gap` loss. It does no
I/O, so it is tested on synthetic entries.

Standard library only: `fanout_client/__init__.py` imports nothing eagerly, and this module neither needs
the WebSocket library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

__all__ = [
    "Event",
    "FanoutError",
    "Loss",
    "LossReason",
    "Message",
    "Position",
    "Stream",
    "TopicKind",
]

TopicKind: TypeAlias = Literal["ring", "snapshot", "private"]
#: `lagged`, `skipped`, `gone`, `epoch`: announced by the gateway (docs/protocol.md). `gap`: a hole the gateway
#: did not announce, seen by this library (should not happen: reported rather than hidden).
LossReason: TypeAlias = Literal["lagged", "skipped", "gone", "epoch", "gap"]
_LOSS_REASONS: dict[str, LossReason] = {"lagged": "lagged", "skipped": "skipped", "gone": "gone", "epoch": "epoch"}
_KINDS: dict[str, TopicKind] = {"ring": "ring", "snapshot": "snapshot", "private": "private"}


class FanoutError(Exception):
    """An error of the gateway (``code``: an error code of docs/protocol.md, e.g. ``forbidden``) or of this
    library: ``timeout``, ``disconnected`` (the connection was lost after the request was sent: it may have
    run), ``queue_full``, ``closed`` (the client is closed; ``close_code`` tells the close that ended it, when
    the gateway ended it), ``token`` (``get_token`` failed), and, from a subscription's iterator, the reason
    it ended (``deleted``, ``taken_over``, ``lost``)."""

    def __init__(self, code: str, message: str, *, close_code: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.close_code = close_code


@dataclass(frozen=True, slots=True)
class Position:
    """Where a stream stands: the epoch and the next seq needed. Pass it as ``since`` to resume exactly."""

    epoch: str
    seq: int


@dataclass(frozen=True, slots=True)
class Message:
    """A message of the topic: ``seq`` increases within ``epoch`` and never comes twice."""

    topic: str
    seq: int
    data: Any
    epoch: str


@dataclass(frozen=True, slots=True)
class Loss:
    """The seqs ``[from_seq, to_seq)`` will never come. ``to_seq`` is None for ``epoch``: the stream restarted
    in the epoch ``epoch`` (at the oldest message the gateway retains). ``epoch``: the one the stream goes on in."""

    topic: str
    from_seq: int
    to_seq: int | None
    reason: LossReason
    epoch: str


Event: TypeAlias = Message | Loss


class Stream:
    """One topic's position and the events its entries make (sans-I/O; the rules of fanout.js's
    `Subscription`). ``subscribed`` is false between a (re)subscribe sent and its ``subscribed`` entry:
    entries of the topic meanwhile belong to an older subscription and are ignored."""

    def __init__(self, topic: str, since: Position | None = None) -> None:
        self.topic = topic
        self.kind: TopicKind | None = None
        self.epoch: str | None = since.epoch if since is not None else None
        #: the next seq this stream needs
        self.next_seq: int | None = since.seq if since is not None else None
        self.subscribed = False

    @property
    def position(self) -> Position | None:
        if self.epoch is None or self.next_seq is None:
            return None
        return Position(self.epoch, self.next_seq)

    def resubscribing(self) -> None:
        """A subscribe (with `position` as ``since``) is on its way: ignore the topic's entries until it is answered."""
        self.subscribed = False

    def on_subscribed(self, kind: str, epoch: str, seq: int) -> list[Event]:
        """The gateway's ``subscribed``: where the stream (re)starts. May report a loss (a private queue whose
        start moved past ours)."""
        resumed = self.epoch is not None and self.next_seq is not None
        self.kind = _KINDS.get(kind, "ring")  # a kind of a newer gateway: handled as the default kind
        self.subscribed = True
        if not resumed or epoch != self.epoch:
            # New, or another epoch (gateway restarted, topic re-created): the stream starts where the gateway
            # says; a ring topic tells the loss with a `loss` entry (`epoch`, `to` null) that follows.
            self.epoch = epoch
            self.next_seq = seq
            return []
        if self.kind == "private" and self.next_seq is not None and seq > self.next_seq:
            # The same queue, taken over, starting past ours: another connection of the user committed entries
            # we never saw. (Starting before ours: the uncommitted entries come again; `on_msg` drops them.)
            return [self._loss(self.next_seq, seq, "gone")]
        return []

    def on_msg(self, seq: int, data: Any) -> list[Event]:
        if not self.subscribed or self.epoch is None:
            return []
        events: list[Event] = []
        if self.next_seq is not None:
            if seq < self.next_seq:
                return []  # had it already: a redelivery, or an older snapshot value
            if seq > self.next_seq and self.kind != "snapshot":
                events.append(self._loss(self.next_seq, seq, "gap"))
        self.next_seq = seq + 1
        events.append(Message(self.topic, seq, data, self.epoch))
        return events

    def on_loss(self, from_seq: int, to_seq: int | None, reason: str) -> list[Event]:
        if not self.subscribed or self.epoch is None:
            return []
        if to_seq is not None:
            if self.next_seq is not None and to_seq <= self.next_seq:
                return []  # a range already behind us
            self.next_seq = to_seq
        # a reason of a newer gateway: reported as `gone` (the range is what counts)
        return [Loss(self.topic, from_seq, to_seq, _LOSS_REASONS.get(reason, "gone"), self.epoch)]

    def _loss(self, from_seq: int, to_seq: int, reason: LossReason) -> Loss:
        assert self.epoch is not None
        self.next_seq = to_seq
        return Loss(self.topic, from_seq, to_seq, reason, self.epoch)
