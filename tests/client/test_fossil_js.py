"""static/fossil.js under Node: it applies the gateway's Fossil deltas (core.fossil) byte for byte, rebuilds a
stream of JSON messages from deltas sent as JSON strings, and refuses bad deltas with DeltaError."""

from __future__ import annotations

import base64
import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from core.fossil import checksum, delta
from tests.core.fossil_corpus import book_pairs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node")

SCRIPT = """
const { applyDelta, checksum, DeltaBase, DeltaError } = await import(process.argv[1]);
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const cases = JSON.parse(Buffer.concat(chunks).toString());
const bytes = (b64) => new Uint8Array(Buffer.from(b64, "base64"));
const refusal = (fn) => {
  try { fn(); return "applied"; } catch (e) { return e instanceof DeltaError ? "DeltaError" : String(e); }
};
const out = {};
out.binary = cases.binary.map(([base, delta]) => Buffer.from(applyDelta(bytes(base), bytes(delta))).toString("base64"));
out.checksums = cases.checksums.map((data) => checksum(bytes(data)));
const stream = new DeltaBase();
out.stream = cases.stream.map(([kind, value]) => JSON.stringify(kind === "whole" ? stream.whole(value) : stream.apply(value)));
out.refused = cases.refused.map(([base, delta]) => refusal(() => applyDelta(bytes(base), bytes(delta))));
const fresh = new DeltaBase();
out.no_base = refusal(() => fresh.apply(cases.stream[1][1]));
const small = new DeltaBase(10);
small.whole('"x"');
out.too_big = refusal(() => small.apply(cases.too_big));
out.after_refusal = refusal(() => small.apply(cases.too_big));
console.log(JSON.stringify(out));
"""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def run_node(cases: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        ["node", "--input-type=module", "-e", SCRIPT, (ROOT / "static" / "fossil.js").as_uri()],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def binary_pairs() -> list[tuple[bytes, bytes]]:
    rng = random.Random(9)
    pairs = [(b"", b""), (b"", b"hello"), (b"hello", b""), (b"x" * 5000, b"x" * 4000 + b"y" + b"x" * 1000)]
    for _ in range(40):
        a = rng.randbytes(rng.randint(0, 1500))
        b = bytearray(a)
        for _ in range(rng.randint(0, 4)):
            start = rng.randint(0, len(b))
            b[start : start + rng.randint(0, 30)] = rng.randbytes(rng.randint(0, 30))
        pairs.append((a, bytes(b)))
    return pairs


def stream_of_books() -> tuple[list[tuple[str, str]], list[Any]]:
    """Entries as a delta subscription gets them: a whole message (its JSON text) when the base is not the
    previous message, else the delta as a JSON string; and the data each one should give."""
    entries: list[tuple[str, str]] = []
    expected: list[Any] = []
    last = None
    for previous, current in book_pairs(seed=21, count=30):
        if last != previous:
            entries.append(("whole", previous.decode()))
            expected.append(orjson.loads(previous))
        entries.append(("delta", orjson.loads(orjson.dumps(delta(previous, current).decode()))))
        expected.append(orjson.loads(current))
        last = current
    text_a = orjson.dumps({"note": "prix €, 价格 🙂 " * 20})
    text_b = orjson.dumps({"note": "价格 🙂 prix € " * 20 + "ø"})
    entries += [("whole", text_a.decode()), ("delta", delta(text_a, text_b).decode())]
    expected += [orjson.loads(text_a), orjson.loads(text_b)]
    return entries, expected


def test_fossil_js_applies_our_deltas_and_refuses_bad_ones():
    pairs = binary_pairs()
    stream, expected = stream_of_books()
    source = b"The quick brown fox jumps over the lazy dog"
    good = delta(source, b"The quick brown cat jumps over the lazy dog")
    other = source.replace(b"fox", b"FOX")
    refused = [
        b"",
        b"5\n",
        b"5\n5:hel",
        good[:-1],
        good + b"x",
        good.replace(b"@", b"!", 1),
        b"5\n9@0,0;",
        b"5\n5:hello3NPMmi;",
        b"5\n" + b"1" * 20 + b":",
        delta(other, other + b"!"),
    ]
    checked = [bytes(range(n)) for n in range(9)] + [b"\xff" * 1001]
    cases = {
        "binary": [[b64(a), b64(delta(a, b))] for a, b in pairs],
        "checksums": [b64(data) for data in checked],
        "stream": stream,
        "refused": [[b64(source), b64(bad)] for bad in refused],
        "too_big": delta(b'"x"', orjson.dumps("y" * 20)).decode(),
    }
    result = run_node(cases)

    assert [base64.b64decode(t) for t in result["binary"]] == [b for _, b in pairs]
    assert result["checksums"] == [checksum(data) for data in checked]
    assert [json.loads(s) for s in result["stream"]] == expected
    assert result["refused"] == ["DeltaError"] * len(refused)
    assert result["no_base"] == "DeltaError"
    assert result["too_big"] == "DeltaError" and result["after_refusal"] == "DeltaError"


ALLOCATION_SCRIPT = """
// Counts the bytes of every Uint8Array made with a length (fossil.js makes its output so): a refused delta
// must cost about its own length, not the size it announces.
const Native = Uint8Array;
let allocated = 0;
globalThis.Uint8Array = class extends Native {
  constructor(...args) {
    if (typeof args[0] === "number") allocated += args[0];
    super(...args);
  }
};
const { applyDelta, DeltaError } = await import(process.argv[1]);
const [base, refused, huge] = JSON.parse(process.argv[2]).map((text) => new TextEncoder().encode(text));
const outcome = (fn) => {
  try { fn(); return "applied"; } catch (e) { return e instanceof DeltaError ? "DeltaError" : e.name; }
};
const outcomes = new Set();
for (let i = 0; i < 200; i++) outcomes.add(outcome(() => applyDelta(base, refused)));
const refusedBytes = allocated;
const hugeOutcome = outcome(() => applyDelta(base, huge, 2 ** 50));
console.log(JSON.stringify({ outcomes: [...outcomes], refusedBytes, hugeOutcome }));
"""


def test_fossil_js_checks_a_delta_before_it_allocates_the_output():
    """An 11-byte delta announcing 16 MiB (one byte inserted) allocated a zeroed 16 MiB buffer before reading
    a command: 200 of them, 3.2 GB allocated (255-478 ms, peak 91 MiB). And one announcing 2^46 bytes,
    under a limit raised past it, threw the engine's RangeError rather than a DeltaError."""
    sixteen_mib = 16 * 1024 * 1024
    refused = "10000\n1:x0;"  # base 64: 64^4 = 16 MiB
    assert len(refused) == 11 and int(refused[0]) * 64**4 == sixteen_mib
    huge = "G0000000\n1:x0;"  # 16 * 64^7 = 2^46 bytes
    done = subprocess.run(
        [
            "node",
            "--input-type=module",
            "-e",
            ALLOCATION_SCRIPT,
            (ROOT / "static" / "fossil.js").as_uri(),
            json.dumps(["base", refused, huge]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcomes"] == ["DeltaError"], result
    assert result["refusedBytes"] <= 200 * len(refused), result  # was 200 x 16 MiB
    assert result["hugeOutcome"] == "DeltaError", result
