"""The seam of client protocols, as centrifuge's decoders chosen once per connection: a protocol reads one
message of its client (a frame, a body) into the typed commands of gateway/schema.py, each run by
gateway/commands.py `run` over the client's session, or into the request errors of those it could not read.

Ours is `JsonProtocol` (docs/protocol.md: one JSON object, or an array of at most 100). Centrifugo's client
protocol (gateway/centrifugo/client_session.py) decodes its commands into the same structs, with what a
Centrifugo subscribe asks besides ours (`Subscribing`: the join/leave choice, the recovery asked); how it
answers each request is its own framer's (gateway/centrifugo/client_frames.py), so the commands know no wire.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from core.errors import RequestError

from . import schema
from .errors import BadCommand, BadJson


class Unread:
    """A command of a message that is not one of ours: the error its `error` entry carries, and its request
    id when that one is valid (so the entry names it)."""

    __slots__ = ("error", "request_id")

    def __init__(self, error: RequestError, request_id: Any) -> None:
        self.error = error
        self.request_id = request_id


class Subscribing(schema.Subscribe, frozen=True):
    """A subscribe of a protocol that says more than ours (Centrifugo's): `join_leave`, whether this
    subscription gets the topic's join/leave entries (ours always do, where the topic has them). The
    recovery it asks is ours, `since`. Never decoded from our JSON: its protocol makes it."""

    join_leave: bool = True


#: one command of a message, as read
Decoded = schema.Command | Unread


class ClientProtocol(Protocol):
    """How one client protocol reads its client's messages (module docstring)."""

    #: its name, in the logs and the bad-input counts
    name: str

    def decode(self, payload: bytes | str) -> list[Decoded]:
        """The commands of one message, in order; raises a RequestError when the message as a whole is not
        one of the protocol (the client gets that error, no command runs)."""


class CommandRunner(Protocol):
    """What runs a session's commands (gateway/commands.py, the module itself): the session reaches it through
    its services, so that the session does not import the commands, which read the session."""

    def handle(self, session: Any, payload: bytes | str) -> int: ...

    def run_decoded(self, session: Any, command: Decoded, *, sent: bool = False) -> None: ...


def parse_commands(payload: bytes | str) -> list[Any]:
    """The JSON values of one frame: one object, or an array of at most 100. Raises BadJson / BadCommand."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadJson(f"not JSON: {exc}") from None
    values = doc if isinstance(doc, list) else [doc]
    if len(values) > schema.MAX_COMMANDS_PER_FRAME:
        raise BadCommand(f"at most {schema.MAX_COMMANDS_PER_FRAME} commands per frame")
    return values


def decode_value(value: Any) -> Decoded:
    """One parsed JSON value as a command, or why it is not one."""
    try:
        return schema.command(value)
    except RequestError as exc:
        return Unread(exc, schema.request_id_of(value))


class JsonProtocol:
    """Our protocol (docs/protocol.md): JSON commands, answered by the engine's entries as they are."""

    name = "json"

    def decode(self, payload: bytes | str) -> list[Decoded]:
        return [decode_value(value) for value in parse_commands(payload)]


#: the one instance every connection of our protocol shares (it holds no state)
JSON_PROTOCOL = JsonProtocol()
