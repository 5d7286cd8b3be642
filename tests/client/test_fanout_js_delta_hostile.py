"""static/fanout.js under Node (its WebSocket: real sockets to 127.0.0.1) and a hostile gateway's deltas
(hardening round 4, finding 5): a websockets server written here answers every subscribe with `subscribed`
and a fossil delta that cannot apply. Unbounded, the library resubscribed at once after each failure:
119,000-141,500 subscribes in 3-4 s, +21 to +32 MiB. Now the resubscribe waits out a backoff (full jitter,
doubling from backoffBaseMs, at most backoffMaxMs; reset by a message that applies), what comes for the topic
meanwhile is ignored, and the table of commands waiting for an answer keeps one subscribe per topic."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import ServerConnection, serve

from tests.client.hostile_deltas import BAD_DELTA, SUBSCRIBED, TOPIC, commands, reset_answer

ROOT = Path(__file__).resolve().parents[2]


def _node_with_websocket() -> list[str] | None:
    """Node and the flag that gives it a WebSocket (Node 20: --experimental-websocket; 22 has it anyway)."""
    if shutil.which("node") is None:
        return None
    for flags in (["--experimental-websocket"], []):
        probe = subprocess.run(
            ["node", *flags, "-e", "process.exit(typeof WebSocket === 'function' ? 0 : 1)"], capture_output=True, timeout=30
        )
        if probe.returncode == 0:
            return ["node", *flags]
    return None


NODE = _node_with_websocket()
pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(NODE is None, reason="needs node with a WebSocket (20 or later)")]


SCRIPT = """
const { connect } = await import(process.argv[1]);
const [base, topic, seconds, backoffBaseMs] = process.argv.slice(2);
const client = connect(base, { transports: ["ws"], pingIntervalMs: 0, backoffBaseMs: Number(backoffBaseMs) });
const sub = client.subscribe(topic, { delta: "fossil" });
const messages = [];
sub.on("message", ({ seq, data }) => messages.push([seq, data]));
let peakPending = 0;
const sample = setInterval(() => { peakPending = Math.max(peakPending, client._pending.size); }, 5);
await new Promise((resolve) => setTimeout(resolve, Number(seconds) * 1000));
clearInterval(sample);
console.log(JSON.stringify({ peakPending, failures: sub.deltaFailures, applied: sub.deltasApplied,
  retries: sub._deltaRetries, reconnects: client.reconnects, state: sub.state, messages }));
client.close();
process.exit(0);
"""


async def _run_node(port: int, seconds: float, backoff_base_ms: int = 500) -> dict[str, Any]:
    assert NODE is not None
    node = await asyncio.create_subprocess_exec(
        *NODE,
        "--input-type=module",
        "-e",
        SCRIPT,
        (ROOT / "static" / "fanout.js").as_uri(),
        f"http://127.0.0.1:{port}",
        TOPIC,
        str(seconds),
        str(backoff_base_ms),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(node.communicate(), 45)
    assert node.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def test_failing_deltas_resubscribe_with_backoff_and_a_bounded_table() -> None:
    async def main() -> tuple[int, dict[str, Any]]:
        subscribes = 0

        async def hostile(ws: ServerConnection) -> None:
            nonlocal subscribes
            async for frame in ws:
                for command in commands(frame):
                    if command.get("op") != "subscribe":
                        continue  # unsubscribes are not answered
                    subscribes += 1
                    # answered without its id, then once more unasked: each pair a failed delta
                    await ws.send(orjson.dumps([SUBSCRIBED, BAD_DELTA, SUBSCRIBED, BAD_DELTA]), text=True)

        async with serve(hostile, "127.0.0.1", 0) as server:
            result = await _run_node(server.sockets[0].getsockname()[1], 3.0)  # default backoff
        return subscribes, result

    subscribes, result = asyncio.run(main())
    assert result["state"] != "closed" and result["reconnects"] == 0, result
    # 0.5 s doubling, full jitter: ~4 expected in 3 s (without the backoff: over 100,000)
    assert 1 <= subscribes <= 12, (subscribes, result)
    # one failure per subscribe answered: the second pair came while the resubscribe waited
    assert result["failures"] <= subscribes, (subscribes, result)
    assert result["peakPending"] <= 1, result  # the topic's one subscribe (unsubscribes carry no id)


def test_the_backoff_resets_on_a_message_that_applies_and_resumes_from_its_seq() -> None:
    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        asked: list[dict[str, Any]] = []

        async def gateway(ws: ServerConnection) -> None:
            async for frame in ws:
                for command in commands(frame):
                    if command.get("op") != "subscribe":
                        continue
                    asked.append(command)
                    entries = reset_answer(len(asked), command)
                    await ws.send(orjson.dumps(entries), text=True)

        async with serve(gateway, "127.0.0.1", 0) as server:
            # 20 ms doubling: the five subscribes within ~0.3 s, well inside the 3 s
            result = await _run_node(server.sockets[0].getsockname()[1], 3.0, backoff_base_ms=20)
        return asked, result

    asked, result = asyncio.run(main())
    start = {"epoch": "e1", "seq": 0}
    assert [c.get("since") for c in asked] == [None, start, start, start, {"epoch": "e1", "seq": 2}], asked
    assert result["messages"] == [[0, {"bid": 1}], [1, {"bid": 2}]], result
    assert result["failures"] == 4 and result["applied"] == 1, result
    assert result["retries"] == 1, result  # the messages that applied reset it; the failure after: 1
