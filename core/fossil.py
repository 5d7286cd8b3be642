"""Fossil deltas: the delta format of the Fossil SCM (its delta.c), the one Centrifugo sends to its clients.

`delta(source, target)` encodes ``target`` as edits of ``source``; `apply(source, delta)` rebuilds ``target``
and checks it, raising `DeltaError` on anything malformed. Pure Python, no I/O.

The format, all in ASCII but the inserted bytes:

* ``<size>\\n``: the length of the target;
* ``<n>@<offset>,``: copy ``n`` bytes of the source starting at ``offset``;
* ``<n>:`` and ``n`` raw bytes: insert those bytes;
* ``<checksum>;``: the end; the checksum of the target (`checksum`).

Numbers are written in base 64, most significant digit first, with the digits of `DIGITS`.

The encoder works like Fossil's: the source is cut into blocks of `WINDOW` bytes, indexed by a rolling hash
of each block; a window rolls over the target one byte at a time, and where its hash names a source block,
the match is extended both ways and, when it is worth its command, copied. One pass over each input, and at
most `CHAIN_LIMIT` candidate blocks per target position.

One rule of ours on top: a copy never starts or ends inside a UTF-8 character of the target. So when the
target is valid UTF-8 (JSON text), every inserted run is valid UTF-8 and so is the whole delta: it travels
as a JSON string, which is how the gateway sends it, and comes back as the same bytes with ``.encode()``.
"""

from __future__ import annotations

import struct
from itertools import accumulate

__all__ = [
    "CHAIN_LIMIT",
    "DIGITS",
    "DeltaError",
    "MAX_TARGET_BYTES",
    "NotWorthIt",
    "WINDOW",
    "apply",
    "check",
    "checksum",
    "delta",
]

#: the digits of the format's numbers, value 0 to 63
DIGITS = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~"
_DIGIT_VALUE = tuple(DIGITS.find(bytes([byte])) for byte in range(256))
#: bytes hashed per window; also the size of the indexed source blocks (Fossil's NHASH)
WINDOW = 16
#: candidate source blocks tried per target position: bounds the work on repetitive inputs (Fossil's value)
CHAIN_LIMIT = 250
#: `apply` refuses a delta announcing a larger target unless told otherwise: copies can repeat the source,
#: so a small delta could otherwise ask for gigabytes. Far above a gateway message (1 MiB at most).
MAX_TARGET_BYTES = 16 * 1024 * 1024
#: longest number read: 48 bits, past any size and the 32-bit checksum; exact in JavaScript too (static/fossil.js)
MAX_NUMBER_DIGITS = 8
#: a match of this many bytes is compared in one slice before the comparison looks closer
_FIRST_STRIDE = 32
#: how far past a copy's end a change may run before the source is looked for again where that copy left
#: it (`_realigned`), the shifts tried there (nearest first), and the shortest copy taken that way
REALIGN_SPAN = 24
REALIGN_SHIFT = 3
_SHIFTS = (0, *(s for k in range(1, REALIGN_SHIFT + 1) for s in (k, -k)))
REALIGN_MIN = 6

_NEWLINE, _COPY, _COMMA, _INSERT, _END = b"\n"[0], b"@"[0], b","[0], b":"[0], b";"[0]


#: with `worth_it`, the encoder gives up once more than this many target bytes found no copy and they are
#: over half of the target read so far: such a delta would save less than half, and unrelated inputs cost
#: the encoder its most (~0.6 us a byte, compiled), for nothing
GIVE_UP_BYTES = 4096
#: how often (target positions without a match) the encoder looks whether to give up
_GIVE_UP_EVERY = 256


class DeltaError(ValueError):
    """A delta that is malformed, does not fit its source or does not rebuild the target it announced."""


class NotWorthIt(Exception):
    """`delta` with ``worth_it`` gave up: the delta would not save half of the target (`GIVE_UP_BYTES`)."""


# -- checksum and numbers -----------------------------------------------------------------------------------


def checksum(data: bytes) -> int:
    """Fossil's 32-bit checksum: the sum, modulo 2**32, of the data read as big-endian 32-bit words (the last
    one padded with zero bytes)."""
    padded = data + b"\0" * (-len(data) % 4)
    words: tuple[int, ...] = struct.unpack(f">{len(padded) // 4}I", padded)
    return sum(words) & 0xFFFFFFFF


def _put_number(out: bytearray, value: int) -> None:
    digits = bytearray()
    while True:
        digits.append(DIGITS[value & 63])
        value >>= 6
        if not value:
            break
    digits.reverse()
    out += digits


def _number_width(value: int) -> int:
    return max(1, (value.bit_length() + 5) // 6)


def _read_number(data: bytes, pos: int) -> tuple[int, int]:
    """The number starting at ``pos`` and the position after it."""
    start = pos
    value = 0
    end = min(len(data), pos + MAX_NUMBER_DIGITS + 1)
    while pos < end:
        digit = _DIGIT_VALUE[data[pos]]
        if digit < 0:
            break
        value = (value << 6) | digit
        pos += 1
    if pos == start:
        raise DeltaError(f"a number was expected at byte {start} of the delta")
    if pos - start > MAX_NUMBER_DIGITS:
        raise DeltaError(f"the number at byte {start} of the delta has more than {MAX_NUMBER_DIGITS} digits")
    return value, pos


# -- encoding -----------------------------------------------------------------------------------------------


def delta(source: bytes, target: bytes, *, worth_it: bool = False) -> bytes:
    """The delta that turns ``source`` into ``target``. With ``worth_it``, raises `NotWorthIt` (early) where the
    delta would not save half of the target."""
    out = bytearray()
    _put_number(out, len(target))
    out.append(_NEWLINE)
    if len(source) < WINDOW:
        if worth_it and len(target) > GIVE_UP_BYTES:
            raise NotWorthIt
        _put_insert(out, target, 0, len(target))  # not one block to copy from
    else:
        _put_edits(out, source, target, worth_it)
    _put_number(out, checksum(target))
    out.append(_END)
    return bytes(out)


def _put_insert(out: bytearray, target: bytes, start: int, end: int) -> None:
    if end > start:
        _put_number(out, end - start)
        out.append(_INSERT)
        out += target[start:end]


def _put_copy(out: bytearray, offset: int, count: int) -> None:
    _put_number(out, count)
    out.append(_COPY)
    _put_number(out, offset)
    out.append(_COMMA)


def _window_hash(data: bytes, start: int) -> tuple[int, int]:
    """The two 16-bit halves of the rolling hash of ``data[start:start + WINDOW]``: the byte sum, and the sum
    weighted by age (the oldest byte counts WINDOW times)."""
    window = data[start : start + WINDOW]
    # the weighted sum is the sum of the running sums: byte i is in WINDOW - i of them
    return sum(window) & 0xFFFF, sum(accumulate(window)) & 0xFFFF


class _SourceIndex:
    """The source's aligned blocks by rolling hash: ``first[h]`` is the first block with hash ``h``, and
    ``following[b]`` the next block after ``b`` with the same hash (or -1). First to last: on a repetitive
    source, the candidates tried are those with the most source after them to match. Keyed by the whole
    hash, not a slot of it (as Fossil does): the format does not depend on it, and fewer blocks are tried."""

    def __init__(self, source: bytes) -> None:
        self.first: dict[int, int] = {}
        self.following = [-1] * (len(source) // WINDOW)
        for block in reversed(range(len(self.following))):
            low, high = _window_hash(source, block * WINDOW)
            key = low | high << 16
            self.following[block] = self.first.get(key, -1)
            self.first[key] = block


def _put_edits(out: bytearray, source: bytes, target: bytes, worth_it: bool) -> None:
    index = _SourceIndex(source)
    size = len(target)
    base = 0  # target bytes before it are written to the delta
    source_end = 0  # where the last copy ended in the source (the start: both begin alike, as JSON does)
    inserted = 0  # target bytes written as inserts so far
    while base + WINDOW < size:
        near = _realigned(source, target, base, source_end)
        if near is not None:
            start, offset, count = near
            inserted += start - base
            _put_insert(out, target, base, start)
            _put_copy(out, offset, count)
            base, source_end = start + count, offset + count
            continue
        low, high = _window_hash(target, base)
        ahead = 0  # the window starts at base + ahead
        while True:
            block = index.first.get(low | high << 16, -1)
            match = _best_match(source, target, index, block, base, ahead) if block >= 0 else None
            if match is not None:
                start, offset, count = match
                inserted += start - base
                _put_insert(out, target, base, start)
                _put_copy(out, offset, count)
                base, source_end = start + count, offset + count
                break
            if base + ahead + WINDOW >= size:
                _put_insert(out, target, base, size)
                base = size
                break
            leaving, entering = target[base + ahead], target[base + ahead + WINDOW]
            low = (low - leaving + entering) & 0xFFFF
            high = (high - WINDOW * leaving + low) & 0xFFFF
            ahead += 1
            if worth_it and ahead % _GIVE_UP_EVERY == 0:
                unmatched = inserted + ahead
                if unmatched > GIVE_UP_BYTES and 2 * unmatched > base + ahead:
                    raise NotWorthIt
    _put_insert(out, target, base, size)


def _realigned(source: bytes, target: bytes, base: int, source_end: int) -> tuple[int, int, int] | None:
    """A copy that resumes the source just after a short change: within `REALIGN_SPAN` bytes of ``base``,
    the target agreeing again with the source where the last copy left it, shifted by at most `REALIGN_SHIFT`
    bytes (a value rewritten with as many characters, or a few more or fewer). The block hash finds no copy
    shorter than two blocks between two changes (an unchanged ``,"t":"t0000","n":`` between a new timestamp
    and a new count), so without this they would be inserted whole. (target start, source offset, length)."""
    size, limit = len(target), len(source)
    for ahead in range(REALIGN_SPAN + 1):
        here = base + ahead
        if here >= size:
            return None
        best: tuple[int, int, int] | None = None
        for shift in _SHIFTS:
            at = source_end + ahead + shift
            if not 0 <= at < limit or source[at] != target[here]:
                continue
            forward = _match_forward(source, at, target, here)
            start, offset, count = _whole_characters(target, here, at, forward)
            cost = _number_width(start - base) + _number_width(count) + _number_width(offset) + 3
            if count >= max(cost, REALIGN_MIN) and (best is None or count > best[2]):
                best = (start, offset, count)
        if best is not None:
            return best
    return None


def _best_match(
    source: bytes, target: bytes, index: _SourceIndex, block: int, base: int, ahead: int
) -> tuple[int, int, int] | None:
    """(target start, source offset, length) of the longest copy worth its command among ``block`` and the
    blocks of the same hash after it, each match grown forward from the window and backward down to ``base``."""
    here = base + ahead
    best: tuple[int, int, int] | None = None
    best_count = 0
    tries = CHAIN_LIMIT
    while block >= 0 and tries > 0:
        tries -= 1
        at = block * WINDOW
        block = index.following[block]
        forward = _match_forward(source, at, target, here)
        if forward == 0:
            continue  # a hash collision
        backward = _match_backward(source, at, target, here, min(at, ahead))
        start, offset, count = _whole_characters(target, here - backward, at - backward, forward + backward)
        cost = _number_width(start - base) + _number_width(count) + _number_width(offset) + 3
        if count >= cost and count > best_count:
            best, best_count = (start, offset, count), count
    return best


def _match_forward(source: bytes, at: int, target: bytes, here: int) -> int:
    """How many bytes of ``source[at:]`` and ``target[here:]`` agree: slices of doubling size, then halving."""
    limit = min(len(source) - at, len(target) - here)
    if limit <= 0 or source[at] != target[here]:
        return 0  # most candidates of a hash slot: settled by one byte
    matched = 0
    stride = _FIRST_STRIDE
    while matched < limit:
        size = min(stride, limit - matched)
        if source[at + matched : at + matched + size] != target[here + matched : here + matched + size]:
            return matched + _agreeing_prefix(source, at + matched, target, here + matched, size)
        matched += size
        stride *= 2
    return matched


def _agreeing_prefix(source: bytes, at: int, target: bytes, here: int, size: int) -> int:
    """The agreeing prefix of two ``size``-byte runs known to differ: a binary search of equal halves."""
    agreed, differs = 0, size  # the first `agreed` bytes agree; the first `differs` do not
    while differs - agreed > 1:
        middle = (agreed + differs) // 2
        if source[at + agreed : at + middle] == target[here + agreed : here + middle]:
            agreed = middle
        else:
            differs = middle
    return agreed


def _match_backward(source: bytes, at: int, target: bytes, here: int, limit: int) -> int:
    """How many bytes before ``source[at]`` and ``target[here]`` agree, at most ``limit``."""
    count = 0
    while count < limit and source[at - count - 1] == target[here - count - 1]:
        count += 1
    return count


def _is_continuation(target: bytes, position: int) -> bool:
    return position < len(target) and 0x80 <= target[position] < 0xC0


def _whole_characters(target: bytes, start: int, offset: int, count: int) -> tuple[int, int, int]:
    """The copy narrowed so that it neither starts nor ends inside a UTF-8 character of the target. At most 3
    bytes at each end (a character has at most 3 continuation bytes): binary targets lose little."""
    for _ in range(3):
        if count > 0 and _is_continuation(target, start):
            start, offset, count = start + 1, offset + 1, count - 1
    for _ in range(3):
        if count > 0 and _is_continuation(target, start + count):
            count -= 1
    return start, offset, count


# -- decoding -----------------------------------------------------------------------------------------------


def apply(source: bytes, delta: bytes, *, max_size: int = MAX_TARGET_BYTES) -> bytes:
    """The target ``delta`` rebuilds from ``source``, checked against its announced size and checksum.
    `DeltaError` for a malformed delta, one that reads outside the source, one announcing more than
    ``max_size`` bytes, or a result whose checksum is not the announced one. Every command is checked
    (`check`) before a byte is built: a short delta of copies (they repeat the source) refused for its
    commands costs a pass over its own bytes, not the megabytes it announces."""
    size, expected = check(len(source), delta, max_size)
    out = bytearray()
    pos = delta.index(_NEWLINE) + 1
    while True:
        value, pos = _read_number(delta, pos)
        command, pos = delta[pos], pos + 1
        if command == _COPY:
            offset, pos = _read_number(delta, pos)
            out += source[offset : offset + value]
            pos += 1  # the comma
        elif command == _INSERT:
            out += delta[pos : pos + value]
            pos += value
        else:  # the end, as `check` found it
            target = bytes(out)
            if checksum(target) != expected:
                raise DeltaError("the rebuilt target does not match the delta's checksum (not the source it was made from?)")
            return target


def check(source_size: int, delta: bytes, max_size: int = MAX_TARGET_BYTES) -> tuple[int, int]:
    """The target size and checksum ``delta`` announces, once every command is found well formed: copies
    within the source, inserts within the delta, the writes adding up to the size it announces (at most
    ``max_size``), the checksum last. One pass over the commands, building nothing; raises `DeltaError`."""
    size, pos = _read_number(delta, 0)
    pos = _expect(delta, pos, _NEWLINE, "the size")
    if size > max_size:
        raise DeltaError(f"the delta announces {size} bytes, more than the {max_size} allowed")
    written = 0
    while pos < len(delta):
        value, pos = _read_number(delta, pos)
        if pos >= len(delta):
            break
        command, pos = delta[pos], pos + 1
        if command == _COPY:
            offset, pos = _read_number(delta, pos)
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
            return size, value
        else:
            raise DeltaError(f"unknown command {bytes([command])!r} at byte {pos - 1} of the delta")
        written += value
        if written > size:
            raise DeltaError(f"the delta writes more than the {size} bytes it announced")
    raise DeltaError("the delta ends before its checksum")


def _expect(data: bytes, pos: int, byte: int, after: str) -> int:
    if pos >= len(data) or data[pos] != byte:
        raise DeltaError(f"{after} is not followed by {bytes([byte])!r} at byte {pos} of the delta")
    return pos + 1
