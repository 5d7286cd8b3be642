"""The forms of a topic's messages for subscriptions with fossil deltas (docs/protocol.md, "Deltas").

A delta subscription gets every message with its `data` as a JSON string holding the data's JSON text as the
gateway encoded it: `"delta": false` and the text itself (whole), or `"delta": true` and the fossil delta
(core/fossil.py) from the text of the message before. A delta goes only to a subscriber whose last message of
the topic was that one (`Subscription.base`), and only when it is shorter than the whole form.

Both forms are made from the message's stored entry, once per message on first use, and shared by every
delta subscriber, as the entry is (docs/design/shared-rings.md §4): a topic nobody reads with deltas never
pays for them.

The encoder runs in the cycle, in Python (compiled: ~80 ms a MiB of similar texts, ~600 of unrelated ones;
encoding the message costs ~0.6 ms a MiB): so a message whose text, or its base's, is over `MAX_DELTA_BYTES`
goes whole, and the encoder gives up (whole) once it is sure to save less than half (core/fossil.py
`GIVE_UP_BYTES`). Before, four to six 1 MB messages to a topic with one delta subscriber stalled the loop
2.7-3.8 s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from . import fossil
from .entries import DATA_KEY, split_message

if TYPE_CHECKING:
    from .client import Subscription

WHOLE_KEY = b',"delta":false,"data":'
DELTA_KEY = b',"delta":true,"data":'
#: the largest data text (of the message and of its base) a delta is made of: at most ~3.4 ms of the cycle
#: for similar texts (~10 ms for unrelated ones where the encoder does not give up early)
MAX_DELTA_BYTES = 64 << 10


def data_text(entry: bytes) -> tuple[int, bytes]:
    """Where the data key of a message entry starts, and the data's JSON text (core/entries.py)."""
    parts = split_message(entry)
    assert parts is not None, "a stored entry is a message entry"
    text = parts[2]
    return len(entry) - 1 - len(text) - len(DATA_KEY), text


def whole_form(entry: bytes) -> bytes:
    at, text = data_text(entry)
    return entry[:at] + WHOLE_KEY + orjson.dumps(text.decode()) + b"}"


def delta_form(entry: bytes, previous: bytes) -> bytes | None:
    """The entry with the delta from `previous`'s data text to its own (valid UTF-8: core/fossil.py); None
    where no delta is made (`MAX_DELTA_BYTES`) or it would not save half."""
    at, text = data_text(entry)
    _, base = data_text(previous)
    if len(text) > MAX_DELTA_BYTES or len(base) > MAX_DELTA_BYTES:
        return None
    try:
        made = fossil.delta(base, text, worth_it=True)
    except fossil.NotWorthIt:
        return None
    return entry[:at] + DELTA_KEY + orjson.dumps(made.decode()) + b"}"


class DeltaForms:
    """One topic's forms, by seq: (stored entry, whole form, delta or whole form, whichever is shorter, or
    None until a subscriber can take a delta). Bound: a ring's retained seqs (`limit`); older ones go."""

    __slots__ = ("forms", "limit", "deltas_sent")

    def __init__(self, limit: int) -> None:
        self.forms: dict[int, tuple[bytes, bytes, bytes | None]] = {}
        self.limit = limit
        #: entries sent as deltas (the rest whole): the gateway's metrics
        self.deltas_sent = 0

    def entry_for(self, sub: Subscription, seq: int, entry: bytes, previous: bytes | None, oldest: int) -> bytes:
        """What delta subscriber `sub` gets for message `seq` (`entry`); `previous`: the topic's message at
        seq - 1, None when it has none; `oldest`: the lowest seq the topic still holds."""
        forms = self.forms.get(seq)
        if forms is None or forms[0] is not entry:  # not made yet, or made for a seq of another epoch
            forms = (entry, whole_form(entry), None)
            self._keep(seq, forms, oldest)
        takes_delta = sub.base == seq - 1 and previous is not None
        sub.base = seq
        if not takes_delta:
            return forms[1]
        assert previous is not None
        best = forms[2]
        if best is None:
            made = delta_form(entry, previous)
            best = made if made is not None and len(made) < len(forms[1]) else forms[1]
            self.forms[seq] = (entry, forms[1], best)
        if best is not forms[1]:
            self.deltas_sent += 1
        return best

    def _keep(self, seq: int, forms: tuple[bytes, bytes, bytes | None], oldest: int) -> None:
        kept = self.forms
        if len(kept) >= self.limit:
            kept = self.forms = {s: f for s, f in kept.items() if s >= oldest}
            if len(kept) >= self.limit:  # a restart's seqs overlap: start over
                kept.clear()
        kept[seq] = forms
