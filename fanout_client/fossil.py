"""Fossil deltas for a subscription that asked for them (``"delta": "fossil"``, docs/protocol.md): each topic's
last message kept as the JSON text the gateway encoded, and the deltas that turn it into the next one.

A ``msg`` entry with ``"delta": true`` carries in ``data`` a JSON string: the Fossil delta from the previous
message's JSON text to this one's. Any other ``msg`` entry is whole and becomes the new base. A delta that
cannot be applied (no base, a malformed delta, a checksum that does not match) raises `DeltaError` and
forgets the base, so that nothing is ever built on wrong data: the caller resubscribes with ``since``, and
the gateway sends the next message whole.

The codec is the gateway's own (`core.fossil`, shipped in the same distribution): one implementation to
test and, later, to compile. Its `apply` builds the target as it reads the commands, so a short malformed
delta of copies (they repeat the base) would build up to ``max_bytes`` before it is refused: `check_commands`
reads every command first, building nothing, so a delta refused for its commands costs a pass over its bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from core.fossil import DIGITS, MAX_NUMBER_DIGITS, MAX_TARGET_BYTES, DeltaError, apply

__all__ = ["DeltaBase", "DeltaError", "check_commands"]

_DIGIT_VALUE = tuple(DIGITS.find(bytes([byte])) for byte in range(256))
_NEWLINE, _COPY, _COMMA, _INSERT, _END = b"\n"[0], b"@"[0], b","[0], b":"[0], b";"[0]


def _number(delta: bytes, pos: int) -> tuple[int, int]:
    start, value = pos, 0
    end = min(len(delta), pos + MAX_NUMBER_DIGITS + 1)
    while pos < end and _DIGIT_VALUE[delta[pos]] >= 0:
        value = (value << 6) | _DIGIT_VALUE[delta[pos]]
        pos += 1
    if pos == start:
        raise DeltaError(f"a number was expected at byte {start} of the delta")
    if pos - start > MAX_NUMBER_DIGITS:
        raise DeltaError(f"the number at byte {start} of the delta has more than {MAX_NUMBER_DIGITS} digits")
    return value, pos


def _expect(delta: bytes, pos: int, byte: int, after: str) -> int:
    if pos >= len(delta) or delta[pos] != byte:
        raise DeltaError(f"{after} is not followed by {bytes([byte])!r} at byte {pos} of the delta")
    return pos + 1


def check_commands(source_size: int, delta: bytes, max_size: int = MAX_TARGET_BYTES) -> None:
    """Raise `DeltaError` unless every command of ``delta`` is well formed, its copies stay within the source,
    its inserts within the delta, and what they write adds up to the size it announces (at most ``max_size``),
    with the checksum last. One pass over the commands, building nothing; the checksum is `apply`'s to check."""
    size, pos = _number(delta, 0)
    pos = _expect(delta, pos, _NEWLINE, "the size")
    if size > max_size:
        raise DeltaError(f"the delta announces {size} bytes, more than the {max_size} allowed")
    written = 0
    while pos < len(delta):
        value, pos = _number(delta, pos)
        if pos >= len(delta):
            break
        command, pos = delta[pos], pos + 1
        if command == _COPY:
            offset, pos = _number(delta, pos)
            pos = _expect(delta, pos, _COMMA, "a copy")
            if offset + value > source_size:
                raise DeltaError(f"a copy of source bytes [{offset}, {offset + value}) past its {source_size} bytes")
        elif command == _INSERT:
            if pos + value > len(delta):
                raise DeltaError(f"an insert of {value} bytes past the end of the delta")
            pos += value
        elif command == _END:
            if pos != len(delta):
                raise DeltaError(f"{len(delta) - pos} bytes after the checksum")
            if written != size:
                raise DeltaError(f"the delta rebuilt {written} bytes, not the {size} it announced")
            return
        else:
            raise DeltaError(f"unknown command {bytes([command])!r} at byte {pos - 1} of the delta")
        written += value
        if written > size:
            raise DeltaError(f"the delta writes more than the {size} bytes it announced")
    raise DeltaError("the delta ends before its checksum")


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
        check_commands(len(base), commands, self.max_bytes)  # before a byte is built
        text = apply(base, commands, max_size=self.max_bytes)
        data = _decoded(text)
        self.text = text
        return data


def _decoded(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DeltaError(f"the rebuilt message is not JSON: {exc}") from None
