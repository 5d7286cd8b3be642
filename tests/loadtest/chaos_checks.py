"""What every chaos run's test asserts beyond its own faults: every client served again within 15 s of each
fault, every client got messages on every shared topic, no log line the run could not read, and the nodes
agree on every shared topic's epoch and position at the end."""

from __future__ import annotations

from typing import Any

from loadtest import chaos


def assert_served_again(result: dict[str, Any]) -> None:
    for name, figures in result["recovery"].items():
        assert figures["unserved"] == 0, (name, figures)
        assert figures["recovery_s"] is not None and figures["recovery_s"]["max"] < 15.0, (name, figures)
    for client, topics in result["check"]["streams"].items():
        for topic in chaos.RING + [chaos.SNAP]:
            assert topics[topic]["messages"] > 0, (client, topic)
    assert result["logs"]["bad_lines"] == 0, result["logs"]["first"]
    # the nodes agree on every shared topic's epoch and position at the end
    assert result["disagree"] == [], result["views"]
