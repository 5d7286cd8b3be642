"""README's table of `gateway` commands shows each usage as the parser takes it: filled in with values, every
row parses (a `--subscribe PATTERN ...` row did not: the flag is repeated, not given several values)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gateway.cli import build_parser

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: a value for each placeholder the rows use
VALUES = {
    "SECONDS": "60",
    "P": "8080",
    "FILE": "gateway.toml",
    "PATH": "ready.json",
    "H": "127.0.0.1",
    "USER": "alice",
    "PATTERN": "news.*",
}


def usage_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^\| `(gateway [^`]+)` \|", text, re.M)


def test_the_readme_lists_every_gateway_command() -> None:
    assert {row.split()[1] for row in usage_rows()} == {"serve", "token", "check-config", "trace-receiver"}


@pytest.mark.parametrize("row", usage_rows())
def test_each_usage_row_filled_in_parses(row: str) -> None:
    words = shlex.split(row.replace("[", " ").replace("]", " "))[1:]
    filled = [VALUES.get(word, word) for word in words]
    unknown = [word for word in filled if re.fullmatch(r"[A-Z]+", word)]
    assert not unknown, f"placeholders without a value here: {unknown}"
    build_parser().parse_args(filled)  # SystemExit (usage error) fails the test
