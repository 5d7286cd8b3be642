"""One schema per wire message, declared once (msgspec Structs) and used by every transport.

A peer's JSON is parsed once (orjson) and then converted to its Struct with `msgspec.convert(...,
strict=True)`: no bool for an int, no float for an int, no string for a number, no unknown field. A value
that does not fit raises the message kind's error (`BadCommand`, `BadRecord`, `BadRequest`) with msgspec's
description of what and where (e.g. "Expected `int`, got `str` - at `$.since.seq`"), so the same bad
field gets the same answer on WebSocket, long-poll, ingest and the admin API. Ranges that carry meaning
(seqs, topic settings) are checked where that meaning lives, the engine, with their own error codes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from core import TopicKind
from core.config import MAX_HOLE_TIMEOUT, MAX_LINGER, TOPIC_INT_BOUNDS
from core.errors import BadSeq, RequestError

from .errors import BadCommand, BadRecord, BadRequest

#: Longest topic name (the engine refuses longer ones with `bad_topic` too: this keeps both in step).
MAX_TOPIC_CHARS = 256
#: Request ids are echoed in replies.
MAX_REQUEST_ID_CHARS = 128
#: Ingest `sync` ids are echoed in `synced`.
MAX_SYNC_ID_CHARS = 128

TopicName = Annotated[str, Meta(min_length=1, max_length=MAX_TOPIC_CHARS)]
#: JavaScript's safe integers: an id is echoed to clients that must hold it exactly
SafeInt = Annotated[int, Meta(ge=-(2**53 - 1), le=2**53 - 1)]
RequestId = Union[SafeInt, Annotated[str, Meta(max_length=MAX_REQUEST_ID_CHARS)], None]


def _check_seq(value: dict[str, Any]) -> None:
    """JSON parsers read an integer literal beyond 64 bits as a float (10**29 -> 1e+29): such a whole number
    is a seq outside [0, 2**53), answered `bad_seq` as -1 or 2**53 are (docs/protocol.md); any other float
    (1.5, 2.0) stays a wrong type, refused by the conversion."""
    seq = value.get("seq")
    if isinstance(seq, float) and seq.is_integer() and not 0 <= seq < 2**53:
        raise BadSeq(f"seq {seq:g} is outside [0, 2**53)")


class _Wire(Struct, forbid_unknown_fields=True, frozen=True):
    """Base of every message a peer sends: unknown fields are refused (a typo never passes silently)."""


# -- commands (WebSocket frames, long-poll bodies) ------------------------------------------------------


class Since(_Wire, frozen=True):
    epoch: str
    seq: int


#: the delta formats a subscriber may ask for (core/delta.py)
DeltaKind = Literal["fossil"]


class Subscribe(_Wire, frozen=True, tag_field="op", tag="subscribe"):
    topic: TopicName
    since: Since | None = None
    #: private topics: entries leave the queue on the client's `ack`, not when written (at-least-once)
    ack: bool = False
    #: messages as fossil deltas of the one before, where the topic's rule has `delta = "fossil"`
    delta: DeltaKind | None = None
    #: handed to the backend's subscribe hook with the request (topics with `proxy_subscribe`), else unused
    data: Any | UnsetType = UNSET
    id: RequestId = None


class Ack(_Wire, frozen=True, tag_field="op", tag="ack"):
    """Every entry of an acknowledged private subscription up to `seq` was handled (cumulative)."""

    topic: TopicName
    seq: int
    id: RequestId = None


class Unsubscribe(_Wire, frozen=True, tag_field="op", tag="unsubscribe"):
    topic: TopicName
    id: RequestId = None


class Publish(_Wire, frozen=True, tag_field="op", tag="publish"):
    topic: TopicName
    data: Any
    id: RequestId = None


class Auth(_Wire, frozen=True, tag_field="op", tag="auth"):
    token: str
    id: RequestId = None


class Rpc(_Wire, frozen=True, tag_field="op", tag="rpc"):
    method: str
    params: Any = None
    id: RequestId = None


class Ping(_Wire, frozen=True, tag_field="op", tag="ping"):
    id: RequestId = None


class Presence(_Wire, frozen=True, tag_field="op", tag="presence"):
    topic: TopicName
    id: RequestId = None


class PresenceStats(_Wire, frozen=True, tag_field="op", tag="presence_stats"):
    topic: TopicName
    id: RequestId = None


Command = Union[Subscribe, Unsubscribe, Publish, Auth, Rpc, Ping, Presence, PresenceStats, Ack]
COMMANDS: tuple[type[Struct], ...] = (Subscribe, Unsubscribe, Publish, Auth, Rpc, Ping, Presence, PresenceStats, Ack)
#: A frame is one command or an array of at most this many.
MAX_COMMANDS_PER_FRAME = 100


# -- TCP ingest records ---------------------------------------------------------------------------------


class PublishRecord(_Wire, frozen=True):
    topic: TopicName
    data: Any
    seq: int | None = None
    #: the user whose private queue gets the message (private topics)
    client: str | None = None


class SyncRecord(_Wire, frozen=True):
    sync: Union[SafeInt, Annotated[str, Meta(max_length=MAX_SYNC_ID_CHARS)], None]


class AuthRecord(_Wire, frozen=True):
    auth: str


Record = Union[PublishRecord, SyncRecord, AuthRecord]


# -- admin API bodies -----------------------------------------------------------------------------------

# Topic settings, with the bounds TopicConfig enforces (core/config.py), so the OpenAPI shows them.
Capacity = Annotated[int, Meta(ge=1, le=TOPIC_INT_BOUNDS["capacity"])]
#: an integer, or "auto" (ring topics: a slice sized by the subscriber's backlog, docs/design/batching.md §8)
BatchDepth = Union[Annotated[int, Meta(ge=1, le=TOPIC_INT_BOUNDS["batch_depth"])], Literal["auto"]]
ReorderWindow = Annotated[int, Meta(ge=1, le=TOPIC_INT_BOUNDS["reorder_window"])]
MaxCount = Annotated[int, Meta(ge=1, le=TOPIC_INT_BOUNDS["max_count"])]
MaxBytes = Annotated[int, Meta(ge=1, le=TOPIC_INT_BOUNDS["max_bytes"])]
HoleTimeout = Annotated[float, Meta(gt=0, le=MAX_HOLE_TIMEOUT)]
#: seconds a shared topic holds its caught-up subscribers back after a publish (0: none)
Linger = Annotated[float, Meta(ge=0, le=MAX_LINGER)]


class CreateTopic(_Wire, frozen=True):
    """`POST /api/topics`. Settings not given come from the rule the name matches, else the defaults."""

    name: TopicName
    kind: TopicKind | UnsetType = UNSET
    capacity: Capacity | UnsetType = UNSET
    batch_depth: BatchDepth | UnsetType = UNSET
    reorder_window: ReorderWindow | UnsetType = UNSET
    hole_timeout: HoleTimeout | UnsetType = UNSET
    linger: Linger | UnsetType = UNSET
    max_count: MaxCount | UnsetType = UNSET
    max_bytes: MaxBytes | UnsetType = UNSET
    client_publish: bool | UnsetType = UNSET
    anonymous: bool | UnsetType = UNSET
    presence: bool | UnsetType = UNSET
    join_leave: bool | UnsetType = UNSET
    proxy_subscribe: bool | UnsetType = UNSET
    proxy_publish: bool | UnsetType = UNSET
    delta: DeltaKind | UnsetType = UNSET

    def settings(self) -> dict[str, Any]:
        """The topic settings given, by name."""
        return {f: v for f in self.__struct_fields__ if f != "name" and (v := getattr(self, f)) is not UNSET}


class PublishBody(_Wire, frozen=True):
    """`POST /api/topics/{name}/publish`: exactly one of `data` (one message) or `messages` (several)."""

    data: Any | UnsetType = UNSET
    messages: list[Any] | UnsetType = UNSET
    #: the user whose private queue gets the messages (private topics)
    client: str | None = None
    #: explicit seq, with `data` only (out-of-order producers)
    seq: int | None = None

    def items(self) -> list[Any]:
        if (self.data is UNSET) == (self.messages is UNSET):
            raise BadRequest("the body must have exactly one of `data` or `messages`")
        if self.messages is not UNSET and self.seq is not None:
            raise BadRequest("`seq` goes with `data` only")
        return [self.data] if self.messages is UNSET else list(self.messages)


class PublishReply(_Wire, frozen=True):
    """Answer of an admin publish: the seqs given, in order."""

    topic: str
    seqs: list[int]


#: Unix seconds, as JWT claims are (finite, 0 .. year 10000)
UnixTime = Annotated[float, Meta(ge=0, le=253402300800)]


class RevokeBody(_Wire, frozen=True):
    """`POST /api/revocations`: exactly one of `jti` (one token; `expires_at`: its `exp`, else the
    revocation lasts `auth.revocation_ttl_s`) or `user` (every token of the user issued before
    `issued_before`, default now)."""

    jti: Annotated[str, Meta(min_length=1, max_length=256)] | UnsetType = UNSET
    user: Annotated[str, Meta(min_length=1, max_length=128)] | UnsetType = UNSET
    issued_before: UnixTime | UnsetType = UNSET
    expires_at: UnixTime | UnsetType = UNSET

    def check(self) -> None:
        if (self.jti is UNSET) == (self.user is UNSET):
            raise BadRequest("the body must have exactly one of `jti` or `user`")
        if self.jti is not UNSET and self.issued_before is not UNSET:
            raise BadRequest("`issued_before` goes with `user`")
        if self.user is not UNSET and self.expires_at is not UNSET:
            raise BadRequest(
                "`expires_at` goes with `jti` (a user's revocation lasts auth.revocation_ttl_s after `issued_before`)"
            )


class UserDisconnected(_Wire, frozen=True):
    """Answer of `DELETE /api/users/{user}`."""

    user: str
    #: connections closed, summed over the nodes that answered (`nodes`)
    disconnected: int
    nodes: int


class ErrorDetail(_Wire, frozen=True):
    code: str
    message: str


class ErrorBody(_Wire, frozen=True):
    """Every HTTP error answer: `{"error": {"code", "message"}}`."""

    error: ErrorDetail


# -- entries (server -> client) -------------------------------------------------------------------------
# The core encodes entries itself, once each (core/entries.py, orjson: the hot path); these declare their
# shape, and the tests decode everything the gateway emits with them, strictly.


class _Entry(Struct, forbid_unknown_fields=True, frozen=True, tag_field="type"):
    """Base of the entries: the `type` field tells which."""


class MsgEntry(_Entry, frozen=True, tag="msg"):
    topic: str
    seq: int
    data: Any
    #: on a subscription granted deltas (core/delta.py): whether `data` is a delta (else the message's text)
    delta: bool | UnsetType = UNSET


class LossEntry(_Entry, frozen=True, tag="loss"):
    topic: str
    #: the half-open range of seqs the client will never see; `to` is null for an `epoch` loss
    from_: int = msgspec.field(name="from")
    to: int | None
    reason: Literal["lagged", "skipped", "gone", "epoch"]


class SubscribedEntry(_Entry, frozen=True, tag="subscribed"):
    topic: str
    kind: TopicKind
    epoch: str
    seq: int
    id: RequestId
    #: given when the subscribe asked for deltas: whether they were granted
    delta: bool | UnsetType = UNSET


class UnsubscribedEntry(_Entry, frozen=True, tag="unsubscribed"):
    topic: str
    id: RequestId


class ReplyEntry(_Entry, frozen=True, tag="reply"):
    id: RequestId
    result: Any


class ErrorEntry(_Entry, frozen=True, tag="error"):
    code: str
    message: str
    id: RequestId = None
    #: long-poll `closed` only: the WebSocket close code it stands for
    close_code: int | UnsetType = UNSET
    #: long-poll `closed` with close_code 1012 (draining): milliseconds to wait before reconnecting
    retry_ms: int | UnsetType = UNSET


class ClosedEntry(_Entry, frozen=True, tag="closed"):
    topic: str
    reason: Literal["deleted", "taken_over"]


class JoinEntry(_Entry, frozen=True, tag="join"):
    topic: str
    user: str | None
    client: str


class LeaveEntry(_Entry, frozen=True, tag="leave"):
    topic: str
    user: str | None
    client: str


Entry = Union[MsgEntry, LossEntry, SubscribedEntry, UnsubscribedEntry, ReplyEntry, ErrorEntry, ClosedEntry, JoinEntry, LeaveEntry]
ENTRIES: tuple[type[Struct], ...] = (
    MsgEntry,
    LossEntry,
    SubscribedEntry,
    UnsubscribedEntry,
    ReplyEntry,
    ErrorEntry,
    ClosedEntry,
    JoinEntry,
    LeaveEntry,
)


# -- conversion -----------------------------------------------------------------------------------------


def _convert(value: Any, kind: Any, error: type[RequestError]) -> Any:
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise error(str(exc)) from None


#: each command's Struct by its `op`: converting to the one Struct costs ~0.35 us, to the `Command` union ~7.5 us
#: (msgspec builds a union's type information on every call); the answers are the same
COMMANDS_BY_OP: dict[str, type[Struct]] = {str(kind.__struct_config__.tag): kind for kind in get_args(Command)}


def command(value: Any) -> Command:
    """A parsed JSON value as a command. Raises BadCommand."""
    if not isinstance(value, dict):
        raise BadCommand("a command is a JSON object")
    op = value.get("op")
    kind = COMMANDS_BY_OP.get(op) if isinstance(op, str) else None  # no or unknown `op`: the union says why
    parsed: Command = _convert(value, Command if kind is None else kind, BadCommand)
    return parsed


def record(value: Any) -> Record:
    """A parsed JSON value as an ingest record; which one is told by its key (`sync`, `auth`, or neither)."""
    if not isinstance(value, dict):
        raise BadRecord("a record is a JSON object")
    kind = SyncRecord if "sync" in value else AuthRecord if "auth" in value else PublishRecord
    if kind is PublishRecord:
        _check_seq(value)
    parsed: Record = _convert(value, kind, BadRecord)
    return parsed


def body(value: Any, kind: type[Struct]) -> Any:
    """A parsed JSON value as an admin API body. Raises BadRequest (BadSeq: `PublishBody.seq`)."""
    if kind is PublishBody and isinstance(value, dict):
        _check_seq(value)
    return _convert(value, kind, BadRequest)


def request_id_of(value: Any) -> Any:
    """The `id` of a command that failed to convert, when it is itself valid (so the error can name it)."""
    if isinstance(value, dict):
        request_id = value.get("id")
        kind = type(request_id)
        if (
            request_id is None
            or (kind is int and -(2**53 - 1) <= request_id <= 2**53 - 1)
            or (kind is str and len(request_id) <= MAX_REQUEST_ID_CHARS)
        ):
            return request_id  # valid as it is (what the conversion below would say, without its ~1.3 us)
        try:
            return msgspec.convert(request_id, RequestId, strict=True)
        except msgspec.ValidationError:
            return None
    return None
