"""The bare reference server (loadtest/bare_server.py): its protocol subset over real sockets, and a short
load run against it (``--target bare``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from fanout_client.ingest import ErrorAnswer, IngestConnection, Synced, record_line
from loadtest import runner
from loadtest.bare_server import BareServer
from loadtest.scenarios import SCENARIOS
from loadtest.target import Target
from loadtest.wsclient import connect


class Listener:
    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.closed = ""

    def ws_open(self) -> None:
        pass

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
        self.frames.extend(orjson.loads(m) for m in messages)

    def ws_closed(self, reason: str) -> None:
        self.closed = reason


async def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _fan_out(target: Target) -> tuple[list[Listener], Synced, list[ErrorAnswer]]:
    listeners = [Listener() for _ in range(3)]
    clients = [await connect(target.host, target.http_port, "/ws", lst) for lst in listeners]
    for i, client in enumerate(clients):
        topics = ["a", "b"] if i == 0 else ["a"]
        client.send_text(orjson.dumps([{"op": "subscribe", "topic": t, "id": k} for k, t in enumerate(topics)]))
    await _wait(lambda: all(lst.frames for lst in listeners))

    def publish() -> tuple[Synced, list[ErrorAnswer]]:
        # the auth line (any token) is line 1; one write: the server reads the five records at once
        with IngestConnection(target.host, target.ingest_port or 0, token="anything") as ingest:
            ingest.write(
                b"".join(
                    [
                        record_line("a", {"n": 0}),
                        record_line("b", "x"),
                        b"not json\n",
                        record_line("a", [1, 2]),
                        record_line("a", None),
                    ]
                )
            )
            synced = ingest.sync(5)
            return synced, ingest.errors

    synced, errors = await asyncio.to_thread(publish)
    await _wait(lambda: sum(len(f) for f in listeners[0].frames[1:]) == 4)
    await _wait(lambda: all(sum(len(f) for f in lst.frames[1:]) == 3 for lst in listeners[1:]))
    for client in clients:
        client.close()
    return listeners, synced, errors


def test_subscribe_publish_and_sync(tmp_path: Path) -> None:
    with BareServer(tmp_path, batch=2) as target:
        assert target.kind == "bare" and target.pid and target.ingest_port
        listeners, synced, errors = asyncio.run(_fan_out(target))
    assert (synced.id, synced.accepted, synced.refused) == (5, 4, 1)
    assert [(e.line, e.code) for e in errors] == [(4, "bad_record")]
    first = listeners[0].frames
    assert [(e["type"], e["topic"], e["kind"], e["seq"], e["id"]) for e in first[0]] == [
        ("subscribed", "a", "ring", 0, 0),
        ("subscribed", "b", "ring", 0, 1),
    ]
    assert first[0][0]["epoch"] == first[0][1]["epoch"]
    # one read of the ingest held three messages of "a": frames of up to 2 entries (--batch 2), in seq order
    a_frames = [f for f in first[1:] if f[0]["topic"] == "a"]
    assert [[e["seq"] for e in f] for f in a_frames] == [[0, 1], [2]]
    assert [e["data"] for f in a_frames for e in f] == [{"n": 0}, [1, 2], None]
    assert [f for f in first[1:] if f[0]["topic"] == "b"] == [[{"type": "msg", "topic": "b", "seq": 0, "data": "x"}]]
    for listener in listeners[1:]:
        assert listener.frames[0] == [
            {"type": "subscribed", "topic": "a", "kind": "ring", "epoch": first[0][0]["epoch"], "seq": 0, "id": 0}
        ]
        assert listener.frames[1:] == a_frames  # the same frames to every subscriber


def test_smoke_run_against_bare(tmp_path: Path) -> None:
    scenario = dataclasses.replace(SCENARIOS["smoke"], duration=2.0)
    summary = runner.run(
        scenario,
        lambda workdir: BareServer(workdir, 1),
        tmp_path,
        Console(record=True, width=120),
        progress=False,
        connect_timeout=10,
    )
    assert summary["target"] == "bare"
    assert summary["clients"]["ready"] == summary["clients"]["planned"]
    assert summary["published"]["sent"] == summary["published"]["accepted"] > 0
    assert summary["loss"] == {**summary["loss"], "silent": 0, "announced": 0, "undelivered": 0, "duplicates": 0}
    clients = json.loads((tmp_path / "clients.json").read_text())
    accepted = summary["published"]["accepted_per_topic"]
    assert summary["deliveries"]["total"] == sum(accepted.get(t, 0) for c in clients for t in c["topics"])
    assert summary["batch_entries"]["mean"] == 1
