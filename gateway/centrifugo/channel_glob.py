"""Channel patterns of the Centrifugo `channels` method (gobwas/glob without separators): `*` any run of
characters, `?` any one, `[abc]`, `[a-z]`, `[!abc]` one of (or none of) a class, `{a,b}` one of the
alternatives, `\\` escapes the next character.

Matched without backtracking (the wildcard walk, O(pattern x name) per name): a regular expression of a
pattern of many stars can take exponential time on a name that almost matches, and this runs for every
topic listed. Alternatives are expanded into plain patterns, at most MAX_ALTERNATIVES of them. Even so a
pattern of 64 alternatives of 200 `?` after a `*` took 3.3 million steps per 256-character name (2.3 s over
10 topics): one call's matching is given `MAX_MATCH_STEPS` steps in all, past which it is refused (106).
"""

from __future__ import annotations

from collections.abc import Callable

from .api_errors import LIMIT_EXCEEDED, ApiError, bad_request

#: a longer pattern is refused
MAX_PATTERN_CHARS = 256
#: `{a,b}{c,d}` makes 4 plain patterns: a pattern that makes more is refused
MAX_ALTERNATIVES = 64

#: steps of the walk one call may take over every name: ~70 ms of CPU; `news.*` over 10,000 topics takes ~300,000
MAX_MATCH_STEPS = 1_000_000

#: one token: a test of one character, or STAR
Token = Callable[[str], bool] | None
STAR: Token = None


def _NOTHING(char: str) -> bool:
    """Past the pattern's end: no character matches."""
    return False


class Matcher:
    """A compiled pattern's test of channel names, within `MAX_MATCH_STEPS` for all the names it is given:
    past them it raises ApiError 106."""

    __slots__ = ("alternatives", "steps_left")

    def __init__(self, alternatives: list[list[Token]], steps: int) -> None:
        self.alternatives = alternatives
        self.steps_left = steps

    def __call__(self, name: str) -> bool:
        for tokens in self.alternatives:
            matched, self.steps_left = _matches(tokens, name, self.steps_left)
            if self.steps_left < 0:
                raise ApiError(
                    LIMIT_EXCEEDED,
                    f"the pattern takes more than {MAX_MATCH_STEPS} steps to match the topics: use fewer alternatives and `?`",
                )
            if matched:
                return True
        return False


def compile_pattern(pattern: str, steps: int = MAX_MATCH_STEPS) -> Matcher:
    """The pattern's test of channel names. Raises ApiError 107 for a malformed or overlong pattern."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise bad_request(f"pattern longer than {MAX_PATTERN_CHARS} characters")
    alternatives, end = _sequence(pattern, 0, nested=False)
    assert end == len(pattern)
    return Matcher(alternatives, steps)


def _sequence(pattern: str, i: int, *, nested: bool) -> tuple[list[list[Token]], int]:
    """The plain token lists of `pattern` from `i` up to its end (or, `nested`, to the `,` or `}` closing an
    alternative), and where it stopped."""
    results: list[list[Token]] = [[]]
    while i < len(pattern):
        char = pattern[i]
        if nested and char in ",}":
            return results, i
        if char == "{":
            options, i = _alternatives(pattern, i + 1)
            results = [head + tail for head in results for tail in options]
            if len(results) > MAX_ALTERNATIVES:
                raise bad_request(f"pattern expands to more than {MAX_ALTERNATIVES} alternatives")
            continue
        token, i = _token(pattern, i)
        for tokens in results:
            tokens.append(token)
    if nested:
        raise bad_request("pattern has a `{` without its `}`")
    return results, i


def _alternatives(pattern: str, i: int) -> tuple[list[list[Token]], int]:
    options: list[list[Token]] = []
    while True:
        found, i = _sequence(pattern, i, nested=True)
        options += found
        if pattern[i] == "}":
            return options, i + 1
        i += 1  # past the `,`


def _token(pattern: str, i: int) -> tuple[Token, int]:
    char = pattern[i]
    if char == "*":
        return STAR, i + 1
    if char == "?":
        return lambda c: True, i + 1
    if char == "[":
        return _char_class(pattern, i)
    if char == "\\":
        if i + 1 == len(pattern):
            raise bad_request("pattern ends with a lone backslash")
        char = pattern[i + 1]
        i += 1
    return char.__eq__, i + 1


def _char_class(pattern: str, i: int) -> tuple[Token, int]:
    end = pattern.find("]", i + 2)
    if end < 0:
        raise bad_request("pattern has a `[` without its `]`")
    body = pattern[i + 1 : end]
    negate = body.startswith("!")
    body = body[1:] if negate else body
    ranges = [(body[k], body[k + 2]) for k in range(len(body) - 2) if body[k + 1] == "-"]
    singles = set(body)

    def test(c: str) -> bool:
        return negate != (c in singles or any(low <= c <= high for low, high in ranges))

    return test, end + 1


def _matches(tokens: list[Token], name: str, steps: int) -> tuple[bool, int]:
    """The wildcard walk: on a mismatch, the last star takes one more character and the rest is tried again.
    Whether it matched and the steps left of `steps` (below 0: it gave up)."""
    p = t = 0
    star = -1
    mark = 0
    while t < len(name):
        steps -= 1
        if steps < 0:
            return False, steps
        token = tokens[p] if p < len(tokens) else _NOTHING
        if token is None:  # STAR
            star, mark = p, t
            p += 1
        elif token(name[t]):
            p += 1
            t += 1
        elif star >= 0:
            p = star + 1
            mark += 1
            t = mark
        else:
            return False, steps
    while p < len(tokens) and tokens[p] is STAR:
        p += 1
    return p == len(tokens), steps
