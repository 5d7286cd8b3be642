"""Fossil deltas for a subscription that asked for them (``"delta": "fossil"``, docs/protocol.md): each topic's
last message kept as the JSON text the gateway encoded, and the deltas that turn it into the next one.

A ``msg`` entry with ``"delta": true`` carries in ``data`` a JSON string: the Fossil delta from the previous
message's JSON text to this one's. Any other ``msg`` entry is whole and becomes the new base. A delta that
cannot be applied (no base, a malformed delta, a checksum that does not match) raises `DeltaError` and
forgets the base, so that nothing is ever built on wrong data: the caller resubscribes with ``since``, and
the gateway sends the next message whole.

The codec is the gateway's own (`core.fossil`, shipped in the same distribution): one implementation to
test and to compile. Its `apply` checks every command before it builds a byte, so a delta refused for its
commands costs a pass over its own bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from core.fossil import MAX_TARGET_BYTES, DeltaError, apply

__all__ = ["DeltaBase", "DeltaError"]


class DeltaBase:
    """One topic's base: the JSON text of its last message. ``max_bytes`` bounds what a delta may rebuild."""

    def __init__(self, max_bytes: int = MAX_TARGET_BYTES) -> None:
        self.max_bytes = max_bytes
        #: the last message's data as the gateway encoded it; None: the next message must come whole
        self.text: bytes | None = None

    def reset(self) -> None:
        """Forget the base (a resubscribe, a loss, a new epoch): the gateway sends the next message whole."""
        self.text = None

    def of_entry(self, entry: Mapping[str, Any]) -> Any:
        """The data of a ``msg`` entry of a subscription granted deltas (it has ``delta``): rebuilt from the
        base when ``delta`` is true, else its ``data`` is the message's JSON text. Raises `DeltaError`."""
        data = entry.get("data")
        if entry.get("delta") is True:
            return self.apply(data)
        if not isinstance(data, str):
            raise DeltaError(f"a whole message of a delta subscription holds its text, not {type(data).__name__}")
        return self.whole_text(data.encode())

    def on_msg(self, data: Any, is_delta: bool) -> Any:
        """The message's data, rebuilt when ``is_delta``; the base moves to it."""
        if is_delta:
            return self.apply(data)
        return self.whole(data)

    def whole(self, data: Any) -> Any:
        """A whole message, decoded from the frame: its text is the gateway's, since both encode with orjson."""
        self.text = orjson.dumps(data)
        return data

    def whole_text(self, text: bytes) -> Any:
        """A whole message given as its JSON text."""
        data = _decoded(text)
        self.text = text
        return data

    def apply(self, delta: Any) -> Any:
        """The data rebuilt from the base and ``delta`` (the entry's ``data``: a JSON string)."""
        base, self.text = self.text, None  # kept only if this one succeeds
        if base is None:
            raise DeltaError("a delta arrived with no message to apply it to")
        if not isinstance(delta, str):
            raise DeltaError(f"a delta must be a JSON string, not {type(delta).__name__}")
        try:
            commands = delta.encode()
        except UnicodeEncodeError as exc:
            raise DeltaError(f"a delta that is no UTF-8 text: {exc}") from None
        text = apply(base, commands, max_size=self.max_bytes)
        data = _decoded(text)
        self.text = text
        return data


def _decoded(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DeltaError(f"the rebuilt message is not JSON: {exc}") from None
