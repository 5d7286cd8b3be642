"""core.fossil: apply(source, delta(source, target)) is target for any inputs, deltas of similar inputs are small,
and a malformed delta raises DeltaError and nothing else."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.fossil import DeltaError, apply, checksum, delta
from tests.core.fossil_corpus import book_pairs

pytestmark = pytest.mark.unit

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)
json_texts = json_values.map(orjson.dumps)


@st.composite
def edited(draw: st.DrawFn, base: st.SearchStrategy[bytes], edits: int = 4, edit_size: int = 20) -> tuple[bytes, bytes]:
    """(a, b): b is a with a few ranges replaced, inserted or deleted."""
    a = draw(base)
    b = bytearray(a)
    for _ in range(draw(st.integers(0, edits))):
        start = draw(st.integers(0, len(b)))
        end = draw(st.integers(start, min(len(b), start + edit_size)))
        b[start:end] = draw(st.binary(max_size=edit_size))
    return a, bytes(b)


@given(st.binary(max_size=600), st.binary(max_size=600))
def test_any_binary_pair_round_trips(a, b):
    assert apply(a, delta(a, b)) == b


@given(edited(st.binary(max_size=3000)))
def test_edited_binary_round_trips(pair):
    a, b = pair
    assert apply(a, delta(a, b)) == b


@given(json_texts, json_texts)
def test_any_json_pair_round_trips(a, b):
    assert apply(a, delta(a, b)) == b


#: characters that share their first bytes (é è ê: c3 a9, c3 a8, c3 aa; € ₭: e2 82 ac, e2 82 ad) or their
#: last one (é ɩ: c3 a9, c9 a9): where a match ends or starts inside a character unless the encoder says no
KIN = "éèêɩ€₭🙂 ab"


@given(st.text(alphabet=KIN, max_size=300), st.data())
def test_a_utf8_target_makes_a_utf8_delta(a, data):
    """A copy never splits a character, so the delta of a text travels as a JSON string and back, unchanged."""
    b = list(a)
    for _ in range(data.draw(st.integers(0, 6))):
        start = data.draw(st.integers(0, len(b)))
        b[start : start + data.draw(st.integers(0, 3))] = data.draw(st.text(alphabet=KIN, max_size=3))
    source, target = a.encode(), "".join(b).encode()
    text = delta(source, target).decode("utf-8")  # raises if a character was split
    assert apply(source, orjson.loads(orjson.dumps(text)).encode()) == target


@given(st.text(max_size=400), st.text(max_size=400))
def test_any_text_pair_makes_a_utf8_delta(a, b):
    source, target = (a + b).encode(), (b + a).encode()
    assert apply(source, delta(source, target).decode("utf-8").encode()) == target


@pytest.mark.parametrize("old, new", [("é", "è"), ("é", "ɩ"), ("€", "₭"), ("🙂", "🙃")])
def test_a_copy_stops_before_a_character_that_differs_in_its_last_or_first_bytes(old, new):
    before, after = "the quick brown fox jumps over ", " the lazy dog, 0123456789 times"  # no block twice
    source, target = (before + old + after).encode(), (before + new + after).encode()
    d = delta(source, target)
    assert d.count(b"@") == 2 and new.encode() in d  # the character is inserted whole, the rest copied
    assert apply(source, d.decode("utf-8").encode()) == target


@settings(max_examples=50)
@given(st.binary(min_size=1000, max_size=4000), st.data())
def test_a_few_small_edits_make_a_small_delta(a, data):
    b = bytearray(a)
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, len(b) - 16))
        b[start : start + data.draw(st.integers(0, 16))] = data.draw(st.binary(min_size=1, max_size=16))
    d = delta(a, bytes(b))
    assert apply(a, d) == b
    assert len(d) <= 200  # at most a fifth of the target


def test_successive_order_books_make_deltas_an_eighth_of_their_size():
    """Books of 1 to 20 levels a side, 3 quantities and the update id changed: each change costs ~25 bytes."""
    pairs = book_pairs(seed=7, count=100, levels=20, changes=3)
    full = sum(len(b) for _, b in pairs)
    sent = 0
    for a, b in pairs:
        d = delta(a, b)
        assert apply(a, d) == b
        sent += len(d)
    assert sent < full / 8


def test_identical_inputs_make_a_delta_of_one_copy():
    a = bytes(range(256)) * 8
    assert delta(a, a).split(b"\n")[1].count(b"@") == 1


def test_repetitive_inputs_stay_quick_and_small():
    """The candidate limit bounds the work on inputs whose blocks all hash alike."""
    a = b"\0" * 200_000
    b = a[:100_000] + b"x" + a[100_000:]
    d = delta(a, b)
    assert apply(a, d) == b and len(d) < 40


def test_the_checksum_is_fossils_big_endian_word_sum():
    assert checksum(b"") == 0
    assert checksum(b"\x00\x00\x01\x02") == 0x0102
    assert checksum(b"\x01") == 0x01000000
    assert checksum(b"\xff\xff\xff\xff\x00\x00\x00\x02") == 1  # modulo 2**32


def test_a_known_delta_is_read():
    # "hello" inserted whole: size 5, insert 5, then its checksum 0x68656C6C + 0x6F000000 in base 64
    assert apply(b"", b"5\n5:hello3NPMmh;") == b"hello"
    assert delta(b"", b"hello") == b"5\n5:hello3NPMmh;"


# -- malformed deltas ---------------------------------------------------------------------------------------

SOURCE = b"The quick brown fox jumps over the lazy dog, again and again and again."
TARGET = b"The quick brown cat jumps over the lazy dog, again and again and again!"
GOOD = delta(SOURCE, TARGET)


def test_the_fixture_delta_copies_and_inserts():
    assert b"@" in GOOD and b":" in GOOD and apply(SOURCE, GOOD) == TARGET


@pytest.mark.parametrize(
    "bad, says",
    [
        (b"", "number was expected"),
        (b"\n", "number was expected"),
        (b"5", "not followed by"),
        (b"5\n", "ends before its checksum"),
        (b"5\n5:hel", "past the end of the delta"),
        (b"5\n5:hello", "ends before its checksum"),
        (b"5\n5:hello3NPMmh", "ends before its checksum"),
        (b"5\n5:hello3NPMmi;", "checksum"),
        (b"5\n5:hello3NPMmh;x", "after the checksum"),
        (b"5\n4:hell3NPMmh;", "rebuilt 4 bytes"),
        (b"4\n5:hello3NPMmh;", "more than the 4 bytes"),
        (b"5\n5!hello3NPMmh;", "unknown command"),
        (b"5\n5@0;", "not followed by b','"),
        (b"5\n5@100,3NPMmh;", "past its"),
        (b"5\n" + b"1" * 20 + b":", "more than 8 digits"),
        (b"\xff\n", "number was expected"),
    ],
)
def test_a_malformed_delta_is_refused_with_a_reason(bad, says):
    with pytest.raises(DeltaError, match=says):
        apply(SOURCE, bad)


def test_a_delta_for_another_source_is_refused():
    other = SOURCE.replace(b"quick", b"QUICK")
    with pytest.raises(DeltaError, match="checksum"):
        apply(other, GOOD)


def test_a_delta_announcing_more_than_allowed_is_refused_before_any_work():
    """Copies may repeat the source: a short delta could otherwise ask for any size."""
    bomb = b"~~~~~\n" + b"".join([b"1~@0,"] * 10) + b"0;"
    with pytest.raises(DeltaError, match="more than the"):
        apply(b"x" * 100, bomb)
    with pytest.raises(DeltaError, match="more than the 4 allowed"):
        apply(b"", b"5\n5:hello3NPMmh;", max_size=4)


@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_delta_error(junk):
    try:
        apply(SOURCE, junk)
    except DeltaError:
        pass


@given(st.integers(0, len(GOOD) - 1), st.integers(0, 255))
def test_a_changed_byte_never_raises_anything_but_delta_error(position, value):
    bad = bytearray(GOOD)
    bad[position] = value
    try:
        apply(SOURCE, bytes(bad))
    except DeltaError:
        pass


@given(st.integers(0, len(GOOD) - 1))
def test_a_truncated_delta_is_refused(length):
    with pytest.raises(DeltaError):
        apply(SOURCE, GOOD[:length])


@given(st.binary(max_size=300), st.binary(max_size=300), st.data())
def test_a_spliced_delta_never_raises_anything_but_delta_error(a, b, data):
    d = bytearray(delta(a, b))
    start = data.draw(st.integers(0, len(d)))
    d[start : data.draw(st.integers(start, len(d)))] = data.draw(st.binary(max_size=8))
    try:
        out = apply(a, bytes(d))
    except DeltaError:
        return
    assert isinstance(out, bytes)


def test_a_large_target_round_trips():
    rng = random.Random(3)
    a = rng.randbytes(300_000)
    b = a[:1000] + rng.randbytes(50) + a[1000:150_000] + a[200_000:]
    d = delta(a, b)
    assert apply(a, d) == b and len(d) < 200


def test_the_encoder_gives_up_early_on_unrelated_texts_and_not_on_related_ones():
    """Issue 45 item 3: with `worth_it`, texts with nothing alike cost the encoder a few KiB of its walk, not
    the whole target (unrelated texts are its costliest: ~0.6 us a byte)."""
    from core.fossil import GIVE_UP_BYTES, NotWorthIt

    rng = random.Random(3)
    source = bytes(rng.randrange(256) for _ in range(1 << 16))
    unrelated = bytes(rng.randrange(256) for _ in range(1 << 16))
    with pytest.raises(NotWorthIt):
        delta(source, unrelated, worth_it=True)
    assert len(delta(source, unrelated)) > len(unrelated)  # without it: a delta longer than the text
    related = bytearray(source)
    for at in range(0, len(related), 997):
        related[at] ^= 0xFF
    assert apply(source, delta(source, bytes(related), worth_it=True)) == related
    short = unrelated[:GIVE_UP_BYTES]  # within the bytes it always tries
    assert apply(source, delta(source, short, worth_it=True)) == short
