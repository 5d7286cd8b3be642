"""The connect hook's server-side subscriptions of a Centrifugo connection, made by its `connect`, with the
recovery its SDK asks for in the command's `subs` (docs/centrifugo.md, "Client protocol").

A reconnecting SDK sends `subs: {CHANNEL: {recover, offset, epoch}}` for the server-side subscriptions it had.
Each channel the hook grants is subscribed here (`catalog.grant`, not by the session's `open`) in the step that
opens the connection, and answered in the connect result's `subs` as Centrifugo answers it: a ring topic is
`recoverable` and `positioned`; a recovery is decided from the ring as a client `subscribe`'s is (complete:
`recovered: true`, the missed publications in `publications`, `offset` the request's; else `recovered: false`,
none, from the end). The publications that fit in `scheduler.cycle_budget_bytes` go in the result, read
from the ring in this step; the subscription starts after them, so the rest follow as pushes, in order, and
none twice. Their `subscribed` entries carry `SERVER_SUB_ID` and are not shown (the result said it all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core import TopicKind
from core.config import MAX_SEQ
from core.entries import split_message
from core.errors import RequestError
from core.ring import RingTopic

from .client_codec import Raw
from .client_frames import SERVER_SUB_ID

if TYPE_CHECKING:
    from ..session import ClientSession
    from ..topic_view import TopicView

#: a recovery asked for: (offset, epoch)
Position = tuple[int, str]


def asked_positions(subs: Any) -> dict[str, Position]:
    """The positions a `connect` command's `subs` asks to recover from (those with `recover`); raises
    ValueError for a field of the wrong type."""
    if subs is None:
        return {}
    if not isinstance(subs, dict):
        raise ValueError("`subs` is an object of channels")
    asked = {}
    for channel, request in subs.items():
        if not isinstance(request, dict):
            raise ValueError("a `subs` entry is an object")
        offset, epoch = request.get("offset", 0), request.get("epoch", "")
        if type(offset) is not int or not 0 <= offset < MAX_SEQ or not isinstance(epoch, str):
            raise ValueError("`subs` offsets are integers in [0, 2**53), epochs strings")
        if request.get("recover"):
            asked[str(channel)] = (offset, epoch)
    return asked


def complete_since(topics: TopicView, channel: str, offset: int, epoch: str) -> bool:
    """Whether every publication after `offset` (the next seq is `offset`) is in the ring, none given up."""
    if not topics.has_topic(channel):
        return False
    topic = topics.topic(channel)
    return isinstance(topic, RingTopic) and epoch == topic.epoch and topic.retains_all_from(offset)


def subscribe_server_side(
    session: ClientSession, channels: tuple[str, ...], asked: dict[str, Position]
) -> dict[str, dict[str, Any]]:
    """Subscribe the connection to `channels` (no permission check: the hook granted them), recovering those
    `asked` names; returns the connect result's `subs`. A refusal is the client's error entry (no result)."""
    services = session.services
    topics, client_id = services.topics, session.identity.client_id
    budget = services.config.scheduler.cycle_budget_bytes  # bytes of publications the result may still hold
    results: dict[str, dict[str, Any]] = {}
    for channel in channels:
        if not session.live:
            break  # cut by an earlier one (its direct queue)
        position = asked.get(channel)
        config = topics.topic_config(channel)
        recovering = (
            position is not None
            and config is not None
            and config.kind is TopicKind.RING
            and complete_since(topics, channel, *position)
        )
        publications: list[dict[str, Any]] = []
        since = None
        if recovering:
            assert position is not None
            offset, epoch = position
            publications, size = _inline(topics.topic(channel), offset, budget)
            budget -= size
            since = (epoch, offset + len(publications))
        try:
            services.catalog.grant(client_id, channel, since=since, request_id=SERVER_SUB_ID)
        except RequestError as exc:
            session.send_error(exc)
            continue
        results[channel] = _result(topics, client_id, channel, position, publications if recovering else None)
    return results


def _inline(topic: Any, offset: int, budget: int) -> tuple[list[dict[str, Any]], int]:
    """The publications after `offset` whose entries fit in `budget` bytes, from the ring, and their size."""
    assert isinstance(topic, RingTopic)
    out: list[dict[str, Any]] = []
    size = 0
    for seq in range(offset, topic.end):
        entry = topic.stored(seq)
        if entry is None or size + len(entry) > budget:
            break  # a seq given up is never in a complete recovery; the rest goes as pushes
        parts = split_message(entry)
        if parts is None:
            break
        size += len(entry)
        out.append({"data": Raw(parts[2]), "offset": seq + 1})
    return out, size


def _result(
    topics: TopicView, client_id: str, channel: str, position: Position | None, publications: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """A subscription's entry in the connect result; `publications` None: not recovered."""
    sub = topics.client(client_id).subs.get(channel)
    if sub is None or not isinstance(sub.topic, RingTopic):
        # not a stream (snapshot, private), or subscribed once the broker brings the topic in: no position
        return {}
    topic = sub.topic
    result: dict[str, Any] = {"recoverable": True, "positioned": True, "epoch": topic.epoch}
    if position is not None:
        result["was_recovering"] = True
    if publications is None or position is None:
        result["offset"] = topic.end
        return result
    result.update(offset=position[0], recovered=True, publications=publications)
    return result
