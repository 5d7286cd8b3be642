"""A config file's `[[topics.rules]]` replaces the shipped rules as a whole (README, "Configuration"): a list
is not merged key by key, and an operator who writes rules gets exactly those, no hidden anonymous `*`.
`gateway check-config` prints the rules in force and says when they replaced the shipped ones."""

from __future__ import annotations

import json

import pytest

from gateway import cli

pytestmark = pytest.mark.unit

ROOM_RULES = """
[[topics.rules]]
pattern = "room.*"
anonymous = true
presence = true
join_leave = true

[[topics.rules]]
pattern = "prices.*"
kind = "snapshot"
"""


@pytest.fixture(autouse=True)
def no_gateway_variables(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)


def check_config(capsys, *args: str) -> tuple[dict, str]:
    assert cli.main(["check-config", *args]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_a_config_files_rules_are_the_rules_in_force_and_check_config_says_they_replaced_the_shipped_ones(
    tmp_path, capsys
) -> None:
    path = tmp_path / "rooms.toml"
    path.write_text(ROOM_RULES)
    effective, err = check_config(capsys, str(path))
    assert [r["pattern"] for r in effective["topics"]["rules"]] == ["room.*", "prices.*"]
    # every setting in force, the defaults a rule does not give included
    room, prices = effective["topics"]["rules"]
    assert (room["kind"], room["anonymous"], room["presence"], room["client_publish"]) == ("ring", True, True, False)
    assert (prices["kind"], prices["anonymous"]) == ("snapshot", False)
    assert "replace the 5 shipped rules" in err
    listed = [line.split()[0] for line in err.splitlines() if line.startswith("  ")]
    assert listed == ["room.*", "prices.*"]
    assert "chat.*" not in err and "unknown_topic" in err


def test_without_rules_of_its_own_a_config_keeps_the_shipped_ones_and_says_nothing_of_replacing(tmp_path, capsys) -> None:
    path = tmp_path / "port.toml"
    path.write_text("[server]\nport = 9000\n")
    effective, err = check_config(capsys, str(path))
    patterns = [r["pattern"] for r in effective["topics"]["rules"]]
    assert patterns == ["private.*", "state.*", "chat.*", "feed.*", "*"]
    assert "replace" not in err
    assert [line.split()[0] for line in err.splitlines() if line.startswith("  ")] == patterns


def test_the_presence_snippet_of_integration_md_keeps_the_shipped_rules_it_needs(tmp_path, capsys) -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    (snippet,) = [block for block in text.split("```toml\n")[1:] if 'pattern = "room.*"' in block]
    path = tmp_path / "presence.toml"
    path.write_text(snippet.split("```")[0])
    effective, err = check_config(capsys, str(path))
    assert [r["pattern"] for r in effective["topics"]["rules"]] == ["room.*", "private.*", "chat.*", "*"]
    assert "replace the 5 shipped rules" in err
