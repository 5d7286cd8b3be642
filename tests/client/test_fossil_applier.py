"""fanout_client.fossil.DeltaBase: whole messages become the base, deltas (JSON strings, as the gateway sends
them) rebuild the next message, and a delta that cannot be applied raises DeltaError and forgets the base."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.fossil import delta
from fanout_client.fossil import DeltaBase, DeltaError
from tests.core.fossil_corpus import book_pairs

pytestmark = pytest.mark.unit

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=30,
)


def delta_entry_data(previous: bytes, current: bytes) -> str:
    """What a delta entry's ``data`` decodes to on the client: the delta, as a JSON string."""
    return orjson.loads(orjson.dumps(delta(previous, current).decode()))


def test_a_stream_of_books_is_rebuilt_from_deltas():
    base = DeltaBase()
    pairs = book_pairs(seed=11, count=40)
    first = orjson.loads(pairs[0][0])
    assert base.on_msg(first, is_delta=False) == first
    for previous, current in pairs:
        if base.text != previous:  # the corpus starts a new book now and then: sent whole
            base.on_msg(orjson.loads(previous), is_delta=False)
        assert base.on_msg(delta_entry_data(previous, current), is_delta=True) == orjson.loads(current)
        assert base.text == current


@given(json_values, json_values)
def test_any_json_value_is_rebuilt_from_the_base_the_client_decoded(previous, current):
    """The base is re-encoded from the decoded data: orjson gives back the gateway's (orjson's) text."""
    base = DeltaBase()
    base.whole(orjson.loads(orjson.dumps(previous)))
    assert base.text == orjson.dumps(previous)
    rebuilt = base.apply(delta_entry_data(orjson.dumps(previous), orjson.dumps(current)))
    assert orjson.dumps(rebuilt) == orjson.dumps(current)


def test_a_whole_text_becomes_the_base():
    base = DeltaBase()
    assert base.whole_text(b'{"a": 1}') == {"a": 1}
    assert base.apply(delta_entry_data(b'{"a": 1}', b'{"a": 2}')) == {"a": 2}
    with pytest.raises(DeltaError, match="not JSON"):
        base.whole_text(b"{")
    assert base.text == b'{"a": 2}'  # a refused whole text leaves the base as it was


def test_a_delta_without_a_base_is_refused():
    base = DeltaBase()
    with pytest.raises(DeltaError, match="no message to apply it to"):
        base.on_msg(delta_entry_data(b"{}", b"[]"), is_delta=True)


@pytest.mark.parametrize(
    "bad, says",
    [
        (12, "must be a JSON string"),
        ({"d": 1}, "must be a JSON string"),
        ("!junk", "number was expected"),
        ("\ud800", "no UTF-8"),
    ],
)
def test_a_bad_delta_is_refused_and_the_base_forgotten(bad, says):
    base = DeltaBase()
    base.whole({"price": 1})
    with pytest.raises(DeltaError, match=says):
        base.apply(bad)
    assert base.text is None
    with pytest.raises(DeltaError, match="no message"):  # nothing is built on it until a whole message comes
        base.apply(delta_entry_data(b'{"price":1}', b'{"price":2}'))


def test_a_delta_for_another_base_is_refused_never_applied():
    base = DeltaBase()
    base.whole({"price": 1, "size": 10, "venue": "north", "book": list(range(20))})
    for_another = delta_entry_data(
        orjson.dumps({"price": 1, "size": 99, "venue": "south", "book": list(range(20))}),
        orjson.dumps({"price": 2, "size": 99, "venue": "south", "book": list(range(20))}),
    )
    with pytest.raises(DeltaError, match="checksum"):
        base.apply(for_another)
    assert base.text is None


def test_a_delta_that_does_not_rebuild_json_is_refused():
    base = DeltaBase()
    base.whole([1, 2, 3])
    with pytest.raises(DeltaError, match="not JSON"):
        base.apply(delta_entry_data(b"[1,2,3]", b"[1,2,"))
    assert base.text is None


def test_a_delta_rebuilding_more_than_the_bound_is_refused():
    base = DeltaBase(max_bytes=100)
    base.whole("x")
    with pytest.raises(DeltaError, match="more than the 100 allowed"):
        base.apply(delta_entry_data(b'"x"', orjson.dumps("y" * 200)))


def test_reset_forgets_the_base():
    base = DeltaBase()
    base.whole(1)
    base.reset()
    with pytest.raises(DeltaError):
        base.apply(delta_entry_data(b"1", b"2"))


def _peak_bytes_of(call: Any) -> int:
    tracemalloc.start()
    try:
        call()
    except DeltaError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    "refused",
    [
        b"10000\n1:x0;",  # 11 bytes announcing 16 MiB, one byte inserted
        # 16 MiB - 1 of copies of a 64 KiB base, then no checksum: built whole before the refusal
        b"~~~~\n" + b"G00@0," * 255 + b"F~~@0,",
        # the same copies, then an insert past the delta's end
        b"~~~~\n" + b"G00@0," * 255 + b"F~~@0," + b"9:x",
    ],
)
def test_a_refused_delta_costs_about_its_own_length(refused: bytes) -> None:
    """Copies repeat the base: a 1.5 KB delta asked core.fossil.apply to build 16 MiB before it found the
    delta malformed. Every command is checked first (fanout_client.fossil), before a byte is built."""
    base = DeltaBase()
    base.whole_text(orjson.dumps("b" * (64 * 1024 - 2)))  # 64 KiB of JSON text
    assert base.text is not None and len(base.text) == 64 * 1024
    text = refused.decode()
    peak = _peak_bytes_of(lambda: base.apply(text))
    assert base.text is None
    assert peak <= 4096 + 4 * len(refused), peak  # the delta's bytes and the error (was 18.5 MB)
