"""The Centrifugo server API's requests, as cent 5.x sends them (its `dto.py`; None fields left out): strict
types, unknown fields refused (a typo never passes silently), each converted with `parse`."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .api_errors import bad_request


class _Request(Struct, forbid_unknown_fields=True, frozen=True):
    pass


class StreamPosition(_Request, frozen=True):
    offset: int = 0
    epoch: str = ""


class DisconnectSpec(_Request, frozen=True):
    code: int = 0
    reason: str = ""


class Publish(_Request, frozen=True):
    channel: str
    data: Any | UnsetType = UNSET
    skip_history: bool | None = None
    tags: dict[str, str] | None = None
    b64data: str | None = None
    idempotency_key: str | None = None


class Broadcast(_Request, frozen=True):
    channels: list[str]
    data: Any | UnsetType = UNSET
    skip_history: bool | None = None
    tags: dict[str, str] | None = None
    b64data: str | None = None
    idempotency_key: str | None = None


class Channel(_Request, frozen=True):
    """presence, presence_stats"""

    channel: str


class History(_Request, frozen=True):
    channel: str
    limit: int | None = None
    since: StreamPosition | None = None
    reverse: bool | None = None


class Subscribe(_Request, frozen=True):
    user: str
    channel: str
    info: Any = None
    b64info: str | None = None
    client: str | None = None
    session: str | None = None
    data: Any = None
    b64data: str | None = None
    recover_since: StreamPosition | None = None
    override: dict[str, Any] | None = None


class Unsubscribe(_Request, frozen=True):
    user: str
    channel: str
    client: str | None = None
    session: str | None = None


class Disconnect(_Request, frozen=True):
    user: str
    client: str | None = None
    session: str | None = None
    whitelist: list[str] | None = None
    disconnect: DisconnectSpec | None = None


class Refresh(_Request, frozen=True):
    user: str
    client: str | None = None
    session: str | None = None
    expired: bool | None = None
    expire_at: int | None = None


class Channels(_Request, frozen=True):
    pattern: str | None = None


class Info(_Request, frozen=True):
    pass


class Batch(_Request, frozen=True):
    commands: list[dict[str, Any]]
    parallel: bool | None = None


def parse(value: Any, kind: type[Struct]) -> Any:
    """A JSON body as `kind`. Raises ApiError 107 naming the field."""
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise bad_request(str(exc)) from None
