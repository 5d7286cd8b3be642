"""A new user's first hour (hardening round 4), on the real `gateway serve`:

- a port already in use stops the start with one line naming the port, its config key and its variable,
  and exit status 2 (README: 2 when a command could not do anything), for every listening port; two of the
  gateway's own listeners on one port are named as such;
- a client at `scheduler.max_subscriptions` is told `too_many_subscriptions`, not `rate_limited`, and a
  subscribe refused by the cap spends no token of `limits.subscribe_rate`.

With `server.workers` > 1 and a sentinel answering nonsense: tests/cluster/test_first_hour_broker.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.gw_helpers import ROOT, collect, send, serve_process, ws_connect

#: every listener on a free port, the raw TCP broadcaster on: the test puts one of them on a port in use
ALL_FREE = {"server": {"port": 0}, "ingest": {"port": 0}, "rawtcp": {"sender_port": 0, "receiver_port": 0}}


def toml(sections: dict[str, dict[str, object]]) -> str:
    return "".join(
        f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())
        for name, values in sections.items()
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def serve_fails(tmp_path: Path, sections: dict[str, dict[str, object]]) -> tuple[int, str]:
    """`gateway serve --config` that is expected to end by itself: its status and its output."""
    config = tmp_path / "gateway.toml"
    config.write_text(toml(sections))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "section, key", [("server", "port"), ("ingest", "port"), ("rawtcp", "sender_port"), ("rawtcp", "receiver_port")]
)
def test_a_port_in_use_is_one_line_naming_the_port_and_its_key_and_exit_status_2(tmp_path, taken_port, section, key) -> None:
    sections: dict[str, dict[str, object]] = {name: dict(values) for name, values in ALL_FREE.items()}
    sections[section][key] = taken_port
    status, output = serve_fails(tmp_path, sections)
    assert status == 2, output
    assert "Traceback" not in output, output
    said = [line for line in output.splitlines() if str(taken_port) in line]
    assert len(said) == 1, output
    assert said[0].startswith("gateway: port ") and "in use" in said[0], said
    assert f"{section}.{key}" in said[0] and f"GATEWAY_{section.upper()}_{key.upper()}" in said[0], said


@pytest.mark.timeout(60)
def test_two_of_the_gateways_own_listeners_on_one_port_are_named(tmp_path, taken_port) -> None:
    # found before anything binds (the bind would only say that the port is in use, as if by another process)
    sections: dict[str, dict[str, object]] = {name: dict(values) for name, values in ALL_FREE.items()}
    sections["ingest"]["port"] = sections["rawtcp"]["receiver_port"] = taken_port
    status, output = serve_fails(tmp_path, sections)
    assert status == 2 and "Traceback" not in output, output
    assert f"gateway: ingest.port and rawtcp.receiver_port are both port {taken_port}" in output, output


def answers(ws, *commands: dict) -> list[dict]:
    """Send each command (each with an `id`) and return the entry answering each, in order."""
    for command in commands:
        send(ws, **command)
    ids = [command["id"] for command in commands]

    def answered(got: list[dict]) -> bool:
        return {entry.get("id") for entry in got} >= set(ids)

    got = collect(ws, answered)
    return [next(entry for entry in got if entry.get("id") == i) for i in ids]


def kinds(entries: list[dict]) -> list[str]:
    return [entry["code"] if entry["type"] == "error" else entry["type"] for entry in entries]


class Gateway:
    def __init__(self, info: dict) -> None:
        self.http_port = info["http_port"]
        self.ws_url = f"ws://127.0.0.1:{self.http_port}/ws"


def limits_gateway(tmp_path: Path, max_subscriptions: int, burst: int):
    # a rate so low that no token comes back during the test
    proc, info = serve_process(
        tmp_path,
        toml(
            {
                "server": {"port": 0},
                "ingest": {"port": 0},
                "rawtcp": {"enabled": False},
                "scheduler": {"max_subscriptions": max_subscriptions},
                "limits": {"subscribe_rate": 0.001, "subscribe_burst": burst},
            }
        ),
    )
    return proc, Gateway(info)


@pytest.mark.timeout(60)
def test_the_subscribe_past_the_cap_is_too_many_subscriptions_not_rate_limited(tmp_path) -> None:
    # the shipped choice: the burst is the cap (a reconnect resubscribes everything at once)
    proc, gw = limits_gateway(tmp_path, max_subscriptions=3, burst=3)
    try:
        with ws_connect(gw) as ws:
            got = answers(ws, *({"op": "subscribe", "topic": f"t{i}", "id": i} for i in range(5)))
            assert kinds(got) == ["subscribed"] * 3 + ["too_many_subscriptions"] * 2, got
            assert "scheduler.max_subscriptions" in got[3]["message"], got[3]
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.timeout(60)
def test_a_subscribe_refused_by_the_cap_spends_no_rate_token(tmp_path) -> None:
    proc, gw = limits_gateway(tmp_path, max_subscriptions=2, burst=3)
    try:
        with ws_connect(gw) as ws:
            got = answers(
                ws,
                {"op": "subscribe", "topic": "a", "id": 1},
                {"op": "subscribe", "topic": "b", "id": 2},
                {"op": "subscribe", "topic": "c", "id": 3},
                {"op": "subscribe", "topic": "d", "id": 4},
                # the third token is still there: the two refused subscribes took none
                {"op": "unsubscribe", "topic": "a", "id": 5},
                # below the cap again, and no token left: now it is the rate
                {"op": "subscribe", "topic": "c", "id": 6},
            )
            assert kinds(got) == [
                "subscribed",
                "subscribed",
                "too_many_subscriptions",
                "too_many_subscriptions",
                "unsubscribed",
                "rate_limited",
            ], got
    finally:
        proc.terminate()
        proc.wait(20)
