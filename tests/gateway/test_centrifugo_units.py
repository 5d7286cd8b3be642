"""The Centrifugo server API's pure parts: channel patterns (gobwas/glob's syntax, matched without
backtracking) and history read from a core ring with holes given up (docs/centrifugo.md, "Server API")."""

from __future__ import annotations

import asyncio

import pytest

from core import Engine, TopicConfig, TopicKind
from gateway.centrifugo.api_errors import ApiError
from gateway.centrifugo.channel_glob import compile_pattern
from gateway.centrifugo.history import HistoryQuery, read
from gateway.centrifugo.idempotency import IdempotentPublishes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("*", "anything", True),
        ("news.*", "news.eu", True),
        ("news.*", "sport.eu", False),
        ("a?c", "abc", True),
        ("a?c", "ac", False),
        ("[a-c]x", "bx", True),
        ("[!a-c]x", "bx", False),
        ("[!a-c]x", "dx", True),
        ("{news,chat}.*", "chat.1", True),
        ("{news,chat}.*", "mail.1", False),
        ("{a,b}{c,d}", "bd", True),
        ("news.\\*", "news.*", True),
        ("news.\\*", "news.x", False),
        ("", "", True),
        ("ab", "abc", False),
        ("*b", "aab", True),
    ],
)
def test_patterns_match_as_centrifugo_documents_them(pattern, name, matches):
    assert compile_pattern(pattern)(name) is matches


def test_a_pattern_of_many_stars_costs_no_backtracking():
    # as a regular expression this pattern takes exponential time on the name
    assert compile_pattern("*a" * 60 + "*b")("a" * 256) is False


def test_a_costly_pattern_is_refused_within_its_step_budget():
    """Issue 45 item 6: 64 alternatives and 200 `?` over 10 names of 256 characters stalled the loop 2.3 s
    (this one: 10.7 million steps, 1.2 s, before the budget)."""
    hostile = "{*,**}" * 6 + "?" * 128 + "x"
    matches = compile_pattern(hostile)
    with pytest.raises(ApiError) as info:
        for n in range(10):
            matches("a" * 255 + f"{n}")
    assert info.value.code == 106
    assert matches.steps_left < 0
    common = compile_pattern("news.*")  # the everyday kind over 10,000 topics fits the budget
    assert sum(common(f"news.{n}" if n % 2 else f"sport.eu.{n}") for n in range(10000)) == 5000


@pytest.mark.parametrize("pattern", ["{open", "[open", "trailing\\", "x" * 257, "{a,b}" * 7])
def test_malformed_or_overlong_patterns_are_107(pattern):
    with pytest.raises(ApiError) as info:
        compile_pattern(pattern)
    assert info.value.code == 107


def ring_with_hole() -> Engine:
    """A ring of 8 holding seqs 2..9 (offsets 3..10), seq 6 given up (published out of order past the window)."""
    engine = Engine()
    engine.create_topic("r", TopicConfig(kind=TopicKind.RING, capacity=8, reorder_window=2))
    for seq in (0, 1, 2, 3, 4, 5, 7, 8, 9):
        engine.publish("r", seq, seq=seq, now=0.0)
    return engine


def offsets(engine: Engine, limit: int, since: tuple[int, str] | None = None, reverse: bool = False) -> list[int]:
    answer = read(engine.topic("r"), HistoryQuery(limit, since, reverse))
    assert answer.offset == 10
    return [offset for offset, _ in answer.rows]


def test_history_skips_given_up_seqs_and_refuses_a_position_that_left_the_ring():
    engine = ring_with_hole()
    epoch = engine.topic("r").epoch
    assert offsets(engine, -1) == [3, 4, 5, 6, 8, 9, 10]  # offset 7 (seq 6) was never published
    assert offsets(engine, 2, (6, epoch)) == [8, 9]
    assert offsets(engine, 2, (9, epoch), reverse=True) == [8, 6]
    with pytest.raises(ApiError) as info:
        offsets(engine, 1, (1, epoch))
    assert info.value.code == 112
    assert offsets(engine, 0, (1, epoch)) == []  # the position only: nothing to miss


def test_an_idempotency_key_publishes_once_even_concurrently_and_a_failure_is_forgotten():
    published: list[int] = []

    async def publish() -> dict:
        await asyncio.sleep(0.01)
        published.append(1)
        return {"offset": len(published)}

    async def failing() -> dict:
        raise ValueError("refused")

    async def main() -> None:
        keys = IdempotentPublishes(max_keys=2)
        assert await asyncio.gather(keys.publish("c", "k", publish), keys.publish("c", "k", publish)) == [
            {"offset": 1},
            {"offset": 1},
        ]
        assert await keys.publish("other", "k", publish) == {"offset": 2}  # per channel
        with pytest.raises(ValueError):
            await keys.publish("c", "bad", failing)
        assert await keys.publish("c", "bad", publish) == {"offset": 3}  # the failure was not remembered
        assert await keys.publish("c", "k", publish) == {"offset": 4}  # forgotten: beyond max_keys, the oldest goes

    asyncio.run(main())
