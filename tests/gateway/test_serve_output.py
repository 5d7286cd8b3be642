"""What `gateway serve` prints at start, on the real process: the builds once, the admin token before
"listening", and a one-line note when a config's `[[topics.rules]]` replaced the shipped rules (README,
"Configuration"). With `server.workers` > 1: tests/cluster/test_worker_output.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.gateway.gw_helpers import serve_process

PORTS = "[server]\nport = 0\n[ingest]\nport = 0\n[rawtcp]\nenabled = false\n"


def serve_output(tmp_path: Path, config_text: str) -> list[str]:
    """The lines `gateway serve --config` prints until it is ready, then stopped with SIGTERM."""
    proc, _ = serve_process(tmp_path, config_text, piped=True)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    return out.splitlines()


def index_of(lines: list[str], start: str) -> int:
    found = [i for i, line in enumerate(lines) if line.startswith(start)]
    assert len(found) == 1, (start, lines)
    return found[0]


@pytest.mark.timeout(60)
def test_serve_prints_the_builds_then_the_admin_token_then_listening_and_notes_replaced_rules(tmp_path) -> None:
    lines = serve_output(tmp_path, PORTS + '[[topics.rules]]\npattern = "room.*"\nanonymous = true\n')
    order = [
        index_of(lines, start) for start in ("core: ", "fan-out writer: ", "admin token (development", "gateway listening on ")
    ]
    assert order == sorted(order), lines
    notes = [line for line in lines if "topics.rules:" in line]
    assert len(notes) == 1 and "replace the 5 shipped rules" in notes[0] and "(room.*)" in notes[0], lines


@pytest.mark.timeout(60)
def test_serve_on_the_shipped_rules_notes_nothing(tmp_path) -> None:
    lines = serve_output(tmp_path, PORTS)
    assert not [line for line in lines if "topics.rules" in line], lines
