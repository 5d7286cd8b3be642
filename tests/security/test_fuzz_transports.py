"""A fuzz run of 27,000 mutated inputs across the four peer-facing parsers of ONE real gateway process.

The gateway runs as a subprocess (`python -m gateway serve --config FILE --ready-file PATH`) on ephemeral
loopback ports with its output captured to a log file, with the config written below (`CONFIG`): limits that
let the fuzzing through instead of refusing it wholesale (publish rate, created topics), `fz.*` topics open to
anonymous clients for subscribing and publishing, JWTs checked with TEST_JWT_SECRET.

Inputs are deterministic mutations (seeded `random.Random` per worker) of a corpus of valid inputs of each
parser: byte flips, truncation, duplication and splicing, inserted JSON fragments, odd numbers (1e400,
10**30, -1, true where integers go), strings where objects go, nesting 300-1100 deep, strings up to and past
the frame/line limit, invalid UTF-8, NUL bytes, random keys. Where they go (counts in `COUNTS`):

- WebSocket command frames on `WS_CONNS` connections, text or binary frames. An input that must close the
  connection (over the frame limit: 1009, invalid UTF-8 in a text frame: 1007) is sent alone once all
  before it was answered and must get exactly that code; the fuzzer then reconnects, sometimes with a
  `?token=` or `?id=` that must be refused at once (4001, 4011, 4006). A few connections let their token
  expire (`token_expired` entry, then 4011). Plus `ws-raw`: frame-level mutations (opcodes, RSV/mask bits,
  lengths, fragmentation, control frames, close payloads) on raw sockets;
- TCP ingest lines, `INGEST_CHUNK` lines per write on `INGEST_CONNS` connections, answers read concurrently;
- long-poll: command bodies (POST /lp/{session}) and session creation with odd headers (POST /lp), one
  keep-alive httpx.Client, a poller draining the session; admin API bodies (POST /api/topics and
  POST /api/topics/{name}/publish with the admin token), one keep-alive httpx.Client.
  An HTTP input costs a round trip of ~1 ms where a frame or a line costs tens of microseconds, and both
  HTTP endpoints end in the same command/JSON parsers already fuzzed through the socket transports: they
  get 500 inputs each, the socket transports the rest.

Flow control and hang detection: after every chunk of inputs a marker (a `ping` with a unique id on
WebSocket, a `sync` with a unique id on the ingest) is sent, and the next chunk waits for the marker of the
previous one (`MARKER_TIMEOUT`): a gateway that stops answering fails the test, it does not stall it.

Checked:
- the gateway logs no traceback and no ERROR/CRITICAL line (peer mistakes are rate-limited WARNING lines
  "bad input (...)"), is alive at the end and answers /healthz;
- its RSS (VmRSS of the subprocess, sampled every 50 ms) stays below the baseline taken after a warm-up
  round plus `RSS_BOUND_MB` (see its comment); above RSS_KILL_MB the gateway is killed to spare the machine;
- every answer is a documented one: WebSocket/long-poll entries are JSON arrays of entries of the documented
  types, with string error codes; close codes are documented ones (1011, internal error, is not); HTTP
  answers are 2xx, or 4xx / 503 / 507 with `{"error": {"code", "message"}}`, never another 5xx; ingest
  answers are JSON lines of type error/synced/authed (`internal_error`, the gateway failing unexpectedly on
  a record, counts as a failure);
- an honest subscriber connected for the whole run, on a topic fed at HONEST_RATE msg/s through the ingest
  by an honest publisher, gets every message, in order, with no loss notice. No fuzzed input can name that
  topic: every generated input that mentions it (raw bytes or decoded topic/name) is drawn again.

Run with `pytest -s` to see the figures (they are also in the assertion message on failure).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import connect as sync_connect

from gateway.testing import TEST_JWT_SECRET, make_token
from tests import web

ROOT = Path(__file__).resolve().parents[2]
SEED = 20250611
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
HONEST_TOPIC = "honest.feed"
HONEST_RATE = 200.0  # messages per second
#: inputs per transport in the measured run (27,000 in all); the warm-up round adds WARMUP. Each (document,
#: field) pair of a corpus is mutated 10 to 30 times on the socket transports (22 x 10 commands, 12 x 6 lines),
#: every document some 20 times over HTTP (each request ~10 ms on a busy machine), every mutation kind
#: hundreds of times
COUNTS = {"ws": 10_000, "ws-raw": 1_000, "ingest": 15_000, "longpoll": 500, "admin": 500}
WARMUP = {"ws": 500, "ws-raw": 24, "ingest": 500, "longpoll": 25, "admin": 25}
#: connections whose token expires while open (close 4011), besides the inputs: all at once, in the run only
#: (they hold nothing once closed, so the RSS baseline needs none)
EXPIRING = {"run": 3, "warmup": 0}
WS_CONNS = 3
INGEST_CONNS = 2
WS_CHUNK = 100
INGEST_CHUNK = 500
RAW_FRAMES_PER_CONN = 5
RAW_PARALLEL = 8
MARKER_TIMEOUT = 20.0
FRAME_LIMIT = 65536  # websocket.max_frame_bytes, ingest.max_line_bytes, longpoll.max_body_bytes
#: Peak RSS over the run may exceed the warm-up baseline by this much. What the fuzzers can make the gateway
#: keep is bounded by the config: fz.* rings hold 16 messages of at most 64 KiB (the few inputs that get that
#: far are mostly much smaller), direct queues 1,024 entries per client, an ingest buffer 4 MiB per
#: connection, some 10 connections at a time, a few hundred topics created by the mutations. Measured growth
#: over the run: +2.5 to +3.5 MB (+12 MB for a run of 100,000 inputs). The bound is five times that, and below
#: the ~21 MB of input the run pushes through the parsers (checked): a gateway that kept what it was sent, or a
#: buffer that grew with the input, fails.
RSS_BOUND_MB = 16
#: protection of the machine: a gateway above this is killed at once (and the run fails)
RSS_KILL_MB = 2048

#: Close codes a WebSocket peer may get (docs/protocol.md; 1000 answers the fuzzer's own close). 1011
#: (internal error) is a gateway bug, not an acceptable answer.
WS_CLOSE_CODES = {1000, 1001, 1007, 1009, 4000, 4001, 4006, 4008, 4009, 4011, 4012}
#: on the raw-frame connections protocol errors (1002) are expected too
RAW_CLOSE_CODES = WS_CLOSE_CODES | {1002, 1008}  # 1008: a message in more than websocket.max_fragments frames
ENTRY_TYPES = {"msg", "loss", "subscribed", "unsubscribed", "reply", "error", "closed"}
LOSS_REASONS = {"lagged", "skipped", "gone", "epoch"}
INGEST_TYPES = {"error", "synced", "authed"}
HTTP_OK_ERRORS = {503, 507}  # documented 5xx: private queue still full / too many topics

CONFIG = f"""\
[server]
host = "127.0.0.1"
port = 0
admin_token = "{ADMIN_TOKEN}"
log_level = "info"
# the stop at the end, after every check: no drain of up to 10 s for the sessions the fuzzers leave open
drain_timeout_s = 0.0

[scheduler]
max_topics = 5000
max_message_bytes = {FRAME_LIMIT}

[websocket]
max_frame_bytes = {FRAME_LIMIT}

[longpoll]
poll_timeout_s = 0.5
max_body_bytes = {FRAME_LIMIT}

[ingest]
port = 0
max_line_bytes = {FRAME_LIMIT}

[rawtcp]
enabled = false

[auth]
jwt_secret = "{TEST_JWT_SECRET}"
leeway_s = 0.0
expired_grace_s = 1.0
# token checks stay rate-limited (per connection: `auth` answered rate_limited), per address high enough that
# the reconnections' refused tokens are answered 4001, not 4029
rate_per_ip = 1000.0
burst_per_ip = 2000

[limits]
publish_rate = 1000000.0
publish_burst = 1000000
max_created_topics = 100000
topic_ttl_s = 5.0

[admin]
publish_timeout_s = 0.2
max_body_bytes = 262144

[[topics.rules]]
pattern = "honest.*"
kind = "ring"
capacity = 1024
anonymous = true

[[topics.rules]]
pattern = "private.*"
kind = "private"
max_count = 64
max_bytes = 262144

[[topics.rules]]
pattern = "fzs.*"
kind = "snapshot"
client_publish = true
anonymous = true

[[topics.rules]]
pattern = "fzt.*"
kind = "ring"
capacity = 16
client_publish = true

[[topics.rules]]
pattern = "fz.*"
kind = "ring"
capacity = 16
batch_depth = 4
reorder_window = 64
hole_timeout = 0.5
client_publish = true
anonymous = true
"""


# -- outcome bookkeeping ---------------------------------------------------------------------------------


class Outcomes:
    """Counters and failures of one worker (each thread has its own: merged at the end)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, list[str]] = {}
        self.bytes_sent = 0

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        samples = self.samples.setdefault(kind, [])
        if len(samples) < 3:
            samples.append(detail[:1500])

    def merge(self, other: "Outcomes") -> None:
        self.counts += other.counts
        self.failures += other.failures
        for kind, samples in other.samples.items():
            mine = self.samples.setdefault(kind, [])
            mine.extend(samples[: max(0, 3 - len(mine))])
        self.bytes_sent += other.bytes_sent


def short(data: bytes | str, limit: int = 300) -> str:
    text = repr(data)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(data)} bytes)"


def check_entry(entry: Any) -> str | None:
    """None when `entry` is a documented entry, else what is wrong with it."""
    if not isinstance(entry, dict):
        return "an entry is not an object"
    kind = entry.get("type")
    if kind not in ENTRY_TYPES:
        return f"unknown entry type {kind!r}"
    if kind == "error":
        if not isinstance(entry.get("code"), str) or not isinstance(entry.get("message"), str):
            return "error entry without string code/message"
        if entry["code"] in ("internal_error",):
            return "internal_error"
        if entry["code"] == "closed" and entry.get("close_code") not in WS_CLOSE_CODES:
            return f"closed with undocumented code {entry.get('close_code')!r}"
    elif kind == "msg":
        if not isinstance(entry.get("topic"), str) or not isinstance(entry.get("seq"), int) or "data" not in entry:
            return "msg without topic/seq/data"
    elif kind == "loss":
        if (
            not isinstance(entry.get("topic"), str)
            or not isinstance(entry.get("from"), int)
            or not (entry.get("to") is None or isinstance(entry.get("to"), int))
            or entry.get("reason") not in LOSS_REASONS
        ):
            return "malformed loss entry"
    elif kind == "subscribed":
        if (
            not isinstance(entry.get("topic"), str)
            or not isinstance(entry.get("seq"), int)
            or not isinstance(entry.get("epoch"), str)
            or entry.get("kind") not in ("ring", "snapshot", "private")
        ):
            return "malformed subscribed entry"
    elif kind in ("unsubscribed", "closed"):
        if not isinstance(entry.get("topic"), str):
            return f"{kind} entry without topic"
    elif kind == "reply":
        if "id" not in entry or "result" not in entry:
            return "reply without id/result"
    return None


def count_entries(out: Outcomes, prefix: str, entries: list, source: str) -> list:
    """Validate and count a batch's entries; returns the entries."""
    for entry in entries:
        problem = check_entry(entry)
        if problem is not None:
            out.fail(f"{prefix}: undocumented entry ({problem})", f"{short(orjson.dumps(entry))} (after {source})")
            continue
        kind = entry["type"]
        out.counts[f"{prefix} entry {kind}"] += 1
        if kind == "error":
            out.counts[f"{prefix} error {entry['code']}"] += 1
    return entries


# -- mutations -------------------------------------------------------------------------------------------

#: JSON (and not-quite-JSON) text dropped into inputs: odd numbers, wrong types, escapes, structure
WEIRD = [
    b"1e400",
    b"1000000000000000000000000000000",
    b"-1",
    b"0",
    b"true",
    b"false",
    b"null",
    b"1.5",
    b"-0.0",
    b"18446744073709551615",
    b"9223372036854775807",
    b"-9223372036854775809",
    b"1e-400",
    b"NaN",
    b"Infinity",
    b'""',
    b'"x"',
    b'"\\u0000"',
    b'"\\ud800"',
    b'"\\udc00\\ud800"',
    b'"\xe2\x82\xac"',
    b"{}",
    b"[]",
    b"[[[]]]",
    b'{"epoch":"e","seq":-1}',
    b'{"epoch":1,"seq":"2"}',
    b'{"a":{"b":{"c":null}}}',
    b'"fz.a"',
    b'"private.x"',
    b'[1,"2",{"3":4}]',
    b'"fzs.s"',
    b'"fzt.t"',
    b'"*"',
    b'"fz.*"',
    b'"' + b"\\" * 4 + b'"',
]
FRAGMENTS = WEIRD + [
    b"\x00",
    b"\xff",
    b"\xfe\xff",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\x80",
    b"\\",
    b'"',
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b",,",
    b" ",
    b"\t",
    b"\r",
    b"/*",
    b"'",
    b'"op":"publish"',
    b'"op":"subscribe"',
    b'"topic":"fz.z"',
    b'"data":',
    b'"id":',
    b'"seq":',
    b'"since":',
    b'"sync":',
    b'"client":"c1"',
    b'"auth":',
    b'"method":"echo"',
    b'"params":',
    b'"token":',
    b'"name":',
    b'"kind":',
    b'"capacity":',
    b'"messages":',
]
INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82", b"\xc0\xaf"]
RAW_SENTINEL = "@@RAW-VALUE@@"


def deep(levels: int, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return b"[" * levels + b"1" + b"]" * levels
    return b'{"a":' * levels + b"1" + b"}" * levels


class Mutator:
    """Deterministic mutations of a corpus of valid inputs (JSON documents)."""

    def __init__(
        self, rng: random.Random, corpus: list[Any], fields: list[tuple[str, ...]], limit: int, newlines: bool = False
    ) -> None:
        self.rng = rng
        self.docs = corpus
        self.texts = [orjson.dumps(doc) for doc in corpus]
        self.fields = fields
        self.limit = limit
        self.newlines = newlines  # ingest: a newline splits the input into several lines

    def raw_value(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.06:
            return deep(rng.randint(300, 1100), rng)
        if roll < 0.10:
            return self.long_string()
        if roll < 0.16:  # random object with random keys
            return self.random_object()
        if roll < 0.22:  # a string with invalid UTF-8 or NUL inside
            return b'"ab' + rng.choice(INVALID_UTF8 + [b"\x00", b"\\u0000"]) + b'cd"'
        return rng.choice(WEIRD)

    def long_string(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.45:
            size = rng.randint(1_000, 8_000)
        elif roll < 0.85:
            size = rng.randint(8_000, self.limit - 200)
        else:  # about the limit: some under, some over
            size = rng.randint(self.limit - 200, self.limit + 2_000)
        fill = rng.choice([b"a", b"\xc3\xa9", b"\\n", b"\\u00e9", b" "])
        return b'"' + fill * (size // len(fill)) + b'"'

    def random_object(self) -> bytes:
        rng = self.rng
        items = []
        for _ in range(rng.randint(1, 20)):
            key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_$0123456789é\x00") for _ in range(rng.randint(0, 12)))
            items.append(orjson.dumps(key) + b":" + rng.choice(WEIRD))
        return b"{" + b",".join(items) + b"}"

    def with_field(self, doc: Any, path: tuple[str, ...], raw: bytes) -> bytes:
        """`doc` serialised with `path` set to the raw JSON text `raw` (which may be invalid JSON)."""
        if isinstance(doc, list):
            dicts = [i for i, item in enumerate(doc) if isinstance(item, dict)]
            if not dicts:
                return orjson.dumps(doc)
            index = self.rng.choice(dicts)
            inner = self.with_field(doc[index], path, raw)
            doc = list(doc)
            doc[index] = RAW_SENTINEL
            return orjson.dumps(doc).replace(f'"{RAW_SENTINEL}"'.encode(), inner, 1)
        if not isinstance(doc, dict):
            return orjson.dumps(doc)
        top = dict(doc)
        node = top
        for key in path[:-1]:
            child = node.get(key)
            child = dict(child) if isinstance(child, dict) else {}
            node[key] = child
            node = child
        node[path[-1]] = RAW_SENTINEL
        return orjson.dumps(top).replace(f'"{RAW_SENTINEL}"'.encode(), raw, 1)

    def structured(self, doc: Any) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.75:
            path = rng.choice(self.fields)
        elif roll < 0.9:  # a random key
            path = ("".join(rng.choice("abcxyz_") for _ in range(rng.randint(1, 6))),)
        else:
            path = (rng.choice(self.fields)[0], "".join(rng.choice("abc") for _ in range(3)))
        return self.with_field(doc, path, self.raw_value())

    def byte_level(self, data: bytes) -> bytes:
        rng = self.rng
        if not data:
            return rng.choice(FRAGMENTS)
        op = rng.randrange(9)
        if op == 0:  # bit flips
            buf = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            return bytes(buf)
        if op == 1:  # random bytes
            buf = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            return bytes(buf)
        if op == 2:  # truncation
            return data[: rng.randrange(len(data))]
        if op == 3:  # duplication of a slice
            a = rng.randrange(len(data))
            b = rng.randint(a, min(len(data), a + 64))
            return data[:b] + data[a:b] * rng.randint(1, 4) + data[b:]
        if op == 4:  # splice with another corpus input
            other = rng.choice(self.texts)
            return data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]
        if op == 5:  # deletion
            a = rng.randrange(len(data))
            return data[:a] + data[a + rng.randint(1, 8) :]
        if op == 6:  # a NUL or invalid UTF-8
            a = rng.randrange(len(data) + 1)
            return data[:a] + rng.choice(INVALID_UTF8 + [b"\x00"]) + data[a:]
        if op == 7 and self.newlines:  # a line break in the middle
            a = rng.randrange(len(data) + 1)
            return data[:a] + b"\n" + data[a:]
        a = rng.randrange(len(data) + 1)  # a JSON fragment
        return data[:a] + rng.choice(FRAGMENTS) + data[a:]

    def one(self) -> bytes:
        rng = self.rng
        index = rng.randrange(len(self.docs))
        doc = self.docs[index]
        roll = rng.random()
        if roll < 0.02:  # valid input as is
            return self.texts[index]
        if roll < 0.04:  # the whole input nested deep
            levels = rng.randint(300, 1100)
            return b"[" * levels + self.texts[index] + b"]" * levels
        if roll < 0.45:
            data = self.structured(doc)
            if rng.random() < 0.25:
                data = self.byte_level(data)
            return data
        data = self.texts[index]
        for _ in range(1 if rng.random() < 0.7 else rng.randint(2, 4)):
            data = self.byte_level(data)
        return data


def _named_topics(payload: bytes, keys: tuple[str, ...]) -> list[str]:
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return []
    items = doc if isinstance(doc, list) else [doc]
    return [item[k] for item in items if isinstance(item, dict) for k in keys if isinstance(item.get(k), str)]


def names_honest(payload: bytes, *, lines: bool = False, keys: tuple[str, ...] = ("topic",)) -> bool:
    """Whether an input could reach the honest topic (raw bytes, or a decoded topic/name that names it)."""
    if b"honest" in payload.lower():
        return True
    parts = payload.split(b"\n") if lines else [payload]
    return any("honest" in name.lower() for part in parts for name in _named_topics(part, keys))


# -- corpora ---------------------------------------------------------------------------------------------


class Tokens:
    def __init__(self) -> None:
        self.ws = make_token("fuzz-ws", subscribe=["fzt.*", "private.*"], publish=["fzt.*"])
        self.other = make_token("fuzz-other", subscribe=["*"])
        self.expired = make_token("fuzz-ws", ttl=-60)
        self.lp = make_token("fuzz-lp", subscribe=["fzt.*"], publish=["fzt.*"])
        self.forged = make_token("fuzz-ws", secret="another-secret-of-at-least-32-bytes!!")


def command_corpus(tokens: Tokens) -> list[Any]:
    return [
        {"op": "subscribe", "topic": "fz.a", "id": 1},
        {"op": "subscribe", "topic": "fz.b", "since": {"epoch": "x-1", "seq": 0}, "id": "s2"},
        {"op": "subscribe", "topic": "fzs.s", "id": 11},
        {"op": "subscribe", "topic": "fzt.t", "id": 12},
        {"op": "subscribe", "topic": "private.x", "id": 13},
        {"op": "unsubscribe", "topic": "fz.a", "id": 3},
        {"op": "publish", "topic": "fz.a", "data": {"k": [1, 2, 3], "s": "v"}, "id": 4},
        {"op": "publish", "topic": "fzs.s", "data": "snap"},
        {"op": "publish", "topic": "fzt.t", "data": 7, "id": 14},
        {"op": "publish", "topic": "private.x", "data": 1, "id": 15},
        {"op": "rpc", "method": "echo", "params": {"a": [1, None, True]}, "id": 5},
        {"op": "rpc", "method": "time", "id": 6},
        {"op": "rpc", "method": "topics", "id": 16},
        {"op": "rpc", "method": "whoami", "id": 17},
        {"op": "ping", "id": 7},
        {"op": "ping"},
        {"op": "auth", "token": tokens.ws, "id": 8},
        {"op": "auth", "token": tokens.other, "id": 18},
        {"op": "auth", "token": tokens.expired, "id": 19},
        {"op": "auth", "token": tokens.forged, "id": 20},
        [{"op": "ping", "id": 9}, {"op": "subscribe", "topic": "fz.c"}, {"op": "publish", "topic": "fz.c", "data": [9]}],
        [{"op": "unsubscribe", "topic": "fz.c", "id": 10}, {"op": "rpc", "method": "echo", "params": "p"}],
    ]


COMMAND_FIELDS = [
    ("op",),
    ("topic",),
    ("id",),
    ("data",),
    ("since",),
    ("since", "epoch"),
    ("since", "seq"),
    ("method",),
    ("params",),
    ("token",),
]


def ingest_corpus() -> list[Any]:
    return [
        {"topic": "fz.a", "data": {"p": 1.5, "q": [1, 2]}},
        {"topic": "fz.b", "seq": 3, "data": [1, 2]},
        {"topic": "fz.d", "seq": 0, "data": "first"},
        {"topic": "fzs.s", "data": "snap"},
        {"topic": "fzt.t", "data": 1},
        {"topic": "private.x", "client": "c1", "data": 1},
        {"topic": "fz.c", "data": None},
        {"topic": "nope", "data": 1},
        {"sync": 1},
        {"sync": "s"},
        {"sync": None},
        {"auth": "tok"},
    ]


INGEST_FIELDS: list[tuple[str, ...]] = [("topic",), ("data",), ("seq",), ("client",), ("sync",), ("auth",)]


def admin_create_corpus() -> list[Any]:
    return [
        {"name": "fz.c1", "capacity": 32},
        {"name": "fz.c2", "kind": "snapshot"},
        {"name": "fz.c3", "kind": "private", "max_count": 8, "max_bytes": 4096},
        {
            "name": "fz.c4",
            "reorder_window": 8,
            "hole_timeout": 0.5,
            "batch_depth": 2,
            "client_publish": True,
            "anonymous": True,
            "linger": 0.01,
        },
        {"name": "fz.c5"},
        {"name": "other.c6", "kind": "ring", "capacity": 8},
    ]


ADMIN_CREATE_FIELDS: list[tuple[str, ...]] = [
    ("name",),
    ("kind",),
    ("capacity",),
    ("batch_depth",),
    ("reorder_window",),
    ("hole_timeout",),
    ("linger",),
    ("max_count",),
    ("max_bytes",),
    ("client_publish",),
    ("anonymous",),
]


def admin_publish_corpus() -> list[Any]:
    return [
        {"data": {"bid": 1.0842}},
        {"messages": [1, "two", {"three": 3}]},
        {"data": "x", "seq": 5},
        {"data": 1, "client": "c1"},
        {"messages": []},
    ]


ADMIN_PUBLISH_FIELDS: list[tuple[str, ...]] = [("data",), ("messages",), ("seq",), ("client",)]
ADMIN_NAMES = ["fz.a", "fz.b", "fzs.s", "fzt.t", "private.x", "fz.c1", "fz.c3", "nope", "fz.a/b", "fz.%", ""]


def draw(mutator: Mutator, check: Callable[[bytes], bool]) -> bytes:
    """The next mutated input that cannot reach the honest topic."""
    while True:
        data = mutator.one()
        if not check(data):
            return data


# -- the gateway process and its RSS ---------------------------------------------------------------------


class Gateway:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen | None = None
        self.http_port = self.ingest_port = 0

    def start(self) -> None:
        config, ready = self.workdir / "gateway.toml", self.workdir / "ready.json"
        config.write_text(CONFIG)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file", str(ready)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"gateway exited:\n{self.log_path.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, "gateway not ready in 30 s"
            if ready.exists():
                try:
                    info = json.loads(ready.read_text())
                except ValueError:
                    info = None
                if info:
                    self.http_port, self.ingest_port = info["http_port"], info["ingest_port"]
                    return
            time.sleep(0.05)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}/ws"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float | None:
        try:
            assert self.proc is not None
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            return None
        return None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(10)
                return
            except subprocess.TimeoutExpired:
                continue


class RssSampler(threading.Thread):
    def __init__(self, gw: Gateway) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.gw = gw
        self.stop_event = threading.Event()
        self.samples: list[tuple[float, float]] = []
        self.peak_since: float = 0.0
        self.killed: float | None = None

    def run(self) -> None:
        assert self.gw.proc is not None
        pid = self.gw.proc.pid
        while not self.stop_event.wait(0.05):
            rss = self.gw.rss_mb()
            if rss is None:
                return
            self.samples.append((time.monotonic(), rss))
            if rss > RSS_KILL_MB and self.killed is None:
                self.killed = rss
                os.killpg(pid, signal.SIGKILL)  # the gateway we started, by its process group
                return

    def peak_after(self, start: float) -> float:
        return max((rss for t, rss in self.samples if t >= start), default=0.0)


# -- the honest pair -------------------------------------------------------------------------------------


class Honest:
    """A subscriber on HONEST_TOPIC for the whole run, fed by a publisher through the ingest at HONEST_RATE."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.problems: list[str] = []
        self.sent = 0
        self.accepted = 0
        self.received = 0
        self.first_seq: int | None = None
        self.stop_publishing = threading.Event()
        self.publisher_done = threading.Event()
        self.stack = contextlib.ExitStack()
        self.ws = self.stack.enter_context(sync_connect(gw.ws_url, open_timeout=5, max_size=None, compression=None))
        self.ws.send(orjson.dumps({"op": "subscribe", "topic": HONEST_TOPIC, "id": "honest"}).decode())
        first = orjson.loads(self.ws.recv(timeout=5))
        assert first[0]["type"] == "subscribed", first
        self.first_seq = first[0]["seq"]
        self.pending = first[1:]
        self.reader = threading.Thread(target=self._read, name="honest-subscriber", daemon=True)
        self.writer = threading.Thread(target=self._publish, name="honest-publisher", daemon=True)
        self.reader.start()
        self.writer.start()

    def _problem(self, text: str) -> None:
        if len(self.problems) < 10:
            self.problems.append(text)

    def _take(self, entries: list) -> None:
        for entry in entries:
            if entry.get("type") != "msg" or entry.get("topic") != HONEST_TOPIC:
                self._problem(f"subscriber got {short(orjson.dumps(entry))} after {self.received} messages")
                continue
            expected = self.received
            assert self.first_seq is not None  # set before the subscriber reads
            if entry["seq"] != self.first_seq + expected or entry["data"] != {"n": expected, "by": "honest"}:
                self._problem(f"expected message {expected}, got {short(orjson.dumps(entry))}")
            self.received += 1

    def _read(self) -> None:
        self._take(self.pending)
        while True:
            if self.publisher_done.is_set() and self.received >= self.accepted:
                return
            try:
                frame = self.ws.recv(timeout=0.5)
            except TimeoutError:
                continue
            except ConnectionClosed as exc:
                self._problem(f"subscriber closed: {exc!r}")
                return
            self._take(orjson.loads(frame))

    def _publish(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.gw.ingest_port), timeout=10)
        answers = sock.makefile("rb")
        start = time.monotonic()
        synced_at = 0
        try:
            while True:
                stopping = self.stop_publishing.is_set()
                due = int((time.monotonic() - start) * HONEST_RATE)
                records = []
                while self.sent < due and not stopping:
                    records.append(orjson.dumps({"topic": HONEST_TOPIC, "data": {"n": self.sent, "by": "honest"}}))
                    self.sent += 1
                if records:
                    sock.sendall(b"\n".join(records) + b"\n")
                if self.sent - synced_at >= 200 or stopping:
                    sock.sendall(orjson.dumps({"sync": self.sent}) + b"\n")
                    while True:
                        answer = orjson.loads(answers.readline())
                        if answer.get("type") == "synced":
                            break
                        self._problem(f"publisher got {answer}")
                    if answer["refused"] or answer["accepted"] != self.sent - synced_at or answer["id"] != self.sent:
                        self._problem(f"publisher sync {answer} after {self.sent} sent ({synced_at} synced)")
                    self.accepted += answer["accepted"]
                    synced_at = self.sent
                if stopping:
                    return
                time.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - reported as the check's failure
            self._problem(f"publisher failed: {exc!r}")
        finally:
            sock.close()
            self.publisher_done.set()

    def finish(self, timeout: float = 15.0) -> None:
        self.stop_publishing.set()
        self.writer.join(timeout)
        self.reader.join(timeout)
        if self.reader.is_alive():
            self._problem(f"subscriber got {self.received} of {self.accepted} messages within {timeout} s")
        self.stack.close()


# -- WebSocket command frames ----------------------------------------------------------------------------


class Markers:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.next = 0

    def new(self) -> str:
        self.next += 1
        return f"mk-{self.prefix}-{self.next}"


def ws_query(rng: random.Random, tokens: Tokens) -> tuple[str, int | None]:
    """The query of a (re)connection, and the close code the gateway must answer it with at once (None: the
    connection is accepted)."""
    roll = rng.random()
    if roll < 0.88:
        return "", None
    if roll < 0.94:
        return "?token=" + tokens.ws, None
    if roll < 0.97:
        return "?token=" + rng.choice([tokens.forged, "garbage", tokens.ws[:-3], "", tokens.ws + "x"]), 4001
    if roll < 0.985:
        return "?token=" + tokens.expired, 4011
    return "?id=fuzzer", 4006


def frame_closes(data: bytes, text: bool) -> int | None:
    """The close code an input must get by itself: over the frame limit 1009, invalid UTF-8 in a text frame
    1007 (RFC 6455 §7.4.1)."""
    if len(data) > FRAME_LIMIT:
        return 1009
    if text:
        try:
            data.decode()
        except UnicodeDecodeError:
            return 1007
    return None


class WSSession:
    """One fuzzing connection: a reader task validating every batch, markers to wait on."""

    def __init__(self, ws, out: Outcomes) -> None:
        self.ws = ws
        self.out = out
        self.recent: collections.deque[bytes] = collections.deque(maxlen=8)
        self.waiting: dict[str, asyncio.Event] = {}
        self.entries: collections.Counter[str] = collections.Counter()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        out = self.out
        while True:
            try:
                frame = await self.ws.recv()
            except ConnectionClosed:
                return
            out.counts["ws frames received"] += 1
            if isinstance(frame, bytes):
                out.fail("ws: binary frame from the gateway", short(frame))
                continue
            try:
                batch = orjson.loads(frame)
            except orjson.JSONDecodeError:
                out.fail("ws: frame is not JSON", short(frame))
                continue
            if not isinstance(batch, list):
                out.fail("ws: frame is not a JSON array", short(frame))
                continue
            source = short(self.recent[-1]) if self.recent else "connect"
            for entry in count_entries(out, "ws", batch, source):
                if not isinstance(entry, dict):
                    continue
                self.entries[entry.get("code") or entry.get("type")] += 1  # type: ignore[index]
                if entry.get("type") == "reply" and isinstance(entry.get("id"), str) and entry["id"] in self.waiting:
                    self.waiting.pop(entry["id"]).set()

    async def ping(self, marker: str) -> asyncio.Event:
        """Send a marker ping; its event is set when its reply comes (all inputs before it were handled)."""
        event = self.waiting[marker] = asyncio.Event()
        await self.ws.send(orjson.dumps({"op": "ping", "id": marker}).decode())
        return event

    async def answered(self, event: asyncio.Event) -> bool:
        """True when the marker came; False when the connection closed first; a hang is a failure."""
        waiter = asyncio.create_task(event.wait())
        done, _ = await asyncio.wait({waiter, self.reader}, timeout=MARKER_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if waiter in done:
            return True
        if self.reader not in done:
            self.out.fail("ws: no answer to a marker ping (hang)", f"last inputs: {[short(r, 120) for r in self.recent]}")
        return False

    async def closed(self, timeout: float = 10.0) -> int | None:
        """Wait for the connection to end; the close code received (None: no close frame)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.reader), timeout)
        except asyncio.TimeoutError:
            self.out.fail(
                "ws: connection still open when it should be closed", f"last inputs: {[short(r, 200) for r in self.recent]}"
            )
            self.reader.cancel()
            self.ws.transport.abort()
            return None
        rcvd = self.ws.protocol.close_rcvd
        return rcvd.code if rcvd is not None else None


async def open_ws(gw: Gateway, out: Outcomes, query: str = ""):
    try:
        ws = await ws_connect(
            gw.ws_url + query,
            open_timeout=10,
            max_size=None,
            compression=None,
            ping_interval=None,
            max_queue=None,
            close_timeout=5,
        )
    except InvalidStatus as exc:
        out.counts[f"ws handshake {exc.response.status_code}"] += 1
        if exc.response.status_code != 503:
            out.fail("ws: handshake refused", f"{query[:40]}: {exc!r}")
        return None
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        out.fail("ws: cannot connect", repr(exc))
        await asyncio.sleep(0.1)
        return None
    out.counts["ws connections"] += 1
    return ws


def expect_close(out: Outcomes, code: int | None, expected: int, what: str) -> None:
    out.counts[f"ws close {code}"] += 1
    if code != expected:
        out.fail(f"ws: a connection that must be closed with {expected} was closed with {code}", what)


async def ws_worker(gw: Gateway, out: Outcomes, tokens: Tokens, name: str, count: int) -> None:
    """Mutated command frames, pipelined in chunks of WS_CHUNK with a marker after each. An input that must
    close the connection (too large, invalid UTF-8 in a text frame) is sent alone once everything before it
    was answered, and the close code it gets is checked; the fuzzer then reconnects. (Pipelined past such an
    input, the gateway closes with unread data and the kernel's reset can destroy the close frame.)"""
    rng = random.Random(f"{SEED}-{name}")
    mutator = Mutator(rng, command_corpus(tokens), COMMAND_FIELDS, FRAME_LIMIT)
    markers = Markers(name)
    sent = 0
    first = True
    carry: tuple[bytes, bool] | None = None  # an input whose send failed on a closed connection: sent again

    def next_input() -> tuple[bytes, bool]:
        data = draw(mutator, names_honest)
        try:
            data.decode()
            text = rng.random() < 0.9
        except UnicodeDecodeError:
            text = rng.random() < 0.02  # invalid UTF-8 in a text frame: close 1007
        return data, text

    while sent < count:
        query, refusal = ("", None) if first else ws_query(rng, tokens)
        first = False
        ws = await open_ws(gw, out, query)
        if ws is None:
            continue
        session = WSSession(ws, out)
        if refusal is not None:  # refused at once: nothing to send
            expect_close(out, await session.closed(), refusal, f"connection with {query[:24]}...")
            continue
        previous: asyncio.Event | None = None
        expected: int | None = None
        finished = False
        try:
            while sent < count and not session.reader.done():
                for _ in range(min(WS_CHUNK, count - sent)):
                    data, text = carry if carry is not None else next_input()
                    carry = (data, text)
                    closing = frame_closes(data, text)
                    if closing is not None:  # drain: everything before it answered, then this input alone
                        if not await session.answered(await session.ping(markers.new())):
                            break
                    await ws.send(data, text=text)
                    carry = None
                    expected = closing
                    session.recent.append(data)
                    sent += 1
                    out.bytes_sent += len(data)
                    out.counts[f"ws sent {'text' if text else 'binary'}"] += 1
                    if expected is not None:
                        break
                if expected is not None or session.reader.done():
                    break
                event = await session.ping(markers.new())
                if previous is not None and not await session.answered(previous):
                    break
                previous = event
            else:
                finished = previous is None or await session.answered(previous)
        except ConnectionClosed:
            pass
        if finished:
            await ws.close()
            out.counts["ws closed by the fuzzer"] += 1
            await session.closed()
            continue
        code = await session.closed()
        if expected is not None:
            expect_close(out, code, expected, f"input {short(session.recent[-1], 200)}")
            continue
        out.counts[f"ws close {code}"] += 1
        if code not in WS_CLOSE_CODES:
            out.fail(
                f"ws: closed with {code} (undocumented, or no close frame)",
                f"last inputs: {[short(r, 200) for r in session.recent]}",
            )


async def ws_expiry_worker(gw: Gateway, out: Outcomes, connections: int) -> None:
    """Connections whose token expires while they are open: a `token_expired` error entry, then close 4011
    after auth.expired_grace_s (they send nothing meanwhile, so the close frame cannot be lost). The connections
    are open together: one expiry wait for all."""

    async def one() -> None:
        # 2 s: time for the handshake and the first ping on a loaded machine before the token expires
        ws = await open_ws(gw, out, "?token=" + make_token("fuzz-expiring", ttl=2))
        if ws is None:
            return
        session = WSSession(ws, out)
        await session.ping("before-expiry")
        code = await session.closed(timeout=8)
        expect_close(out, code, 4011, "token expiry")
        if session.entries["token_expired"] != 1:
            out.fail("ws: token expiry without one token_expired entry", repr(session.entries))

    await asyncio.gather(*(one() for _ in range(connections)))


# -- WebSocket raw frames (the frame parser) --------------------------------------------------------------


def ws_frame(
    opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, masked: bool = True, length: int | None = None
) -> bytes:
    n = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([mask_bit | n])
    elif n < 65536:
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def raw_frames(rng: random.Random, mutator: Mutator) -> bytes:
    """One frame-level mutation (sometimes a few frames)."""
    payload = mutator.texts[rng.randrange(len(mutator.texts))]
    op = rng.randrange(16)
    if op == 0:
        return ws_frame(1, payload, rsv=rng.randint(1, 7))
    if op == 1:
        return ws_frame(rng.choice([3, 4, 5, 6, 7, 11, 12, 13, 14, 15]), payload)
    if op == 2:
        return ws_frame(1, payload, masked=False)
    if op == 3:  # continuation without a start
        return ws_frame(0, payload)
    if op == 4:  # a fragmented text message, interleaved with a ping, in order
        half = len(payload) // 2
        return ws_frame(1, payload[:half], fin=False) + ws_frame(9, b"p") + ws_frame(0, payload[half:])
    if op == 5:  # a new message before the previous one ended
        return ws_frame(1, payload[:5], fin=False) + ws_frame(1, payload)
    if op == 6:  # control frame too long, or fragmented
        return ws_frame(9, b"x" * 200) if rng.random() < 0.5 else ws_frame(9, b"x", fin=False)
    if op == 7:  # close frames: odd codes, 1-byte payload, invalid UTF-8 reason
        body = rng.choice(
            [
                b"\x03",
                struct.pack("!H", rng.choice([0, 999, 1004, 1005, 1006, 1015, 2999, 5000])),
                struct.pack("!H", 1000) + b"\xff\xfe",
                struct.pack("!H", 4000) + b"bye",
            ]
        )
        return ws_frame(8, body)
    if op == 8:  # a huge declared length
        return ws_frame(1, payload, length=rng.choice([1 << 62, (1 << 63) - 1, FRAME_LIMIT + 1]))[:40]
    if op == 9:  # a length field shorter than the payload: the rest is read as the next frame header
        return ws_frame(1, payload, length=max(0, len(payload) - rng.randint(1, 10)))
    if op == 10:
        return ws_frame(10, b"unsolicited pong") + ws_frame(2, payload)
    if op == 11:  # bit flips anywhere in a valid frame
        frame = bytearray(ws_frame(1, payload))
        for _ in range(rng.randint(1, 3)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return bytes(frame)
    if op == 12:  # a fragmented message whose pieces add up past the frame limit
        piece = b"[" + b" " * 40_000
        return ws_frame(1, piece, fin=False) + ws_frame(0, b" " * 40_000, fin=False) + ws_frame(0, b"]")
    if op == 13:  # a message in more one-byte fragments than websocket.max_fragments (64): close 1008
        return ws_frame(1, b"[", fin=False) + ws_frame(0, b" ", fin=False) * rng.randint(64, 400) + ws_frame(0, b"]")
    if op == 14:  # a burst of pings: pongs are written, or one waits while writes are paused
        return ws_frame(9, b"p" * rng.randint(0, 125)) * rng.randint(50, 500)
    return ws_frame(1, b"\xef\xbb\xbf" + payload)  # a byte-order mark


def parse_server_frames(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    frames, pos = [], 0
    while len(data) - pos >= 2:
        b0, b1 = data[pos], data[pos + 1]
        n, head = b1 & 0x7F, 2
        if n == 126:
            if len(data) - pos < 4:
                break
            n, head = struct.unpack_from("!H", data, pos + 2)[0], 4
        elif n == 127:
            if len(data) - pos < 10:
                break
            n, head = struct.unpack_from("!Q", data, pos + 2)[0], 10
        if len(data) - pos < head + n:
            break
        frames.append((b0 & 0x0F, data[pos + head : pos + head + n]))
        pos += head + n
    return frames, data[pos:]


async def ws_raw_worker(gw: Gateway, out: Outcomes, tokens: Tokens, name: str, count: int) -> None:
    rng = random.Random(f"{SEED}-{name}")
    mutator = Mutator(rng, command_corpus(tokens), COMMAND_FIELDS, FRAME_LIMIT)
    sent = 0
    while sent < count:
        frames = [raw_frames(rng, mutator) for _ in range(min(RAW_FRAMES_PER_CONN, count - sent))]
        sent += len(frames)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
        except OSError as exc:
            out.fail("ws-raw: cannot connect", repr(exc))
            continue
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        writer.write(
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as exc:
            out.fail("ws-raw: no handshake answer", repr(exc))
            writer.close()
            continue
        if not head.startswith(b"HTTP/1.1 101"):
            out.counts[f"ws-raw handshake {head[:12]!r}"] += 1
            if not head.startswith(b"HTTP/1.1 503"):
                out.fail("ws-raw: handshake refused", short(head))
            writer.close()
            continue
        out.counts["ws-raw connections"] += 1
        try:
            for frame in frames:
                writer.write(frame)
                out.bytes_sent += len(frame)
                out.counts["ws-raw inputs"] += 1
            await writer.drain()
            writer.write_eof()  # the gateway sees the end of the stream: everything after is its answer
        except OSError:
            pass
        data = b""
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
                if not chunk:
                    break
                data += chunk
            else:
                out.fail("ws-raw: connection still open 10 s after the peer's EOF", short(b"".join(frames), 400))
        except asyncio.TimeoutError:
            out.fail("ws-raw: connection still open 10 s after the peer's EOF", short(b"".join(frames), 400))
        except OSError:
            pass
        writer.close()
        parsed, rest = parse_server_frames(data)
        close_code = None
        for opcode, payload in parsed:
            if opcode == 1:
                out.counts["ws-raw frames received"] += 1
                try:
                    batch = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    out.fail("ws-raw: frame is not JSON", short(payload))
                    continue
                if not isinstance(batch, list):
                    out.fail("ws-raw: frame is not a JSON array", short(payload))
                    continue
                count_entries(out, "ws-raw", batch, short(b"".join(frames), 200))
            elif opcode == 8:
                close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        out.counts[f"ws-raw close {close_code}"] += 1
        if close_code is not None and close_code not in RAW_CLOSE_CODES:
            out.fail(f"ws-raw: closed with {close_code}", f"frames {short(b''.join(frames), 600)}")
        if rest:
            out.fail("ws-raw: trailing bytes that are not a frame", short(rest))


# -- TCP ingest ------------------------------------------------------------------------------------------


async def ingest_worker(gw: Gateway, out: Outcomes, name: str, count: int) -> None:
    rng = random.Random(f"{SEED}-{name}")
    mutator = Mutator(rng, ingest_corpus(), INGEST_FIELDS, FRAME_LIMIT, newlines=True)
    markers = Markers(name)
    check = lambda data: names_honest(data, lines=True)  # noqa: E731
    sent = 0
    while sent < count:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.ingest_port, limit=1 << 22)
        except OSError as exc:
            out.fail("ingest: cannot connect", repr(exc))
            await asyncio.sleep(0.1)
            continue
        out.counts["ingest connections"] += 1
        line_no = 0
        #: (first line, last line, input) of recent inputs, to name the input of an answer
        recent: collections.deque[tuple[int, int, bytes]] = collections.deque(maxlen=4 * INGEST_CHUNK)
        waiting: dict[str, asyncio.Event] = {}

        def input_of(line: int) -> str:
            for first_line, last_line, data in recent:
                if first_line <= line <= last_line:
                    return short(data, 600)
            return "?"

        async def read() -> None:
            while True:
                try:
                    raw = await reader.readline()
                except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
                    out.fail("ingest: unreadable answer", repr(exc))
                    return
                if not raw:
                    return
                try:
                    answer = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    out.fail("ingest: answer is not JSON", short(raw))
                    continue
                kind = answer.get("type") if isinstance(answer, dict) else None
                if kind not in INGEST_TYPES:
                    out.fail("ingest: undocumented answer", short(raw))
                    continue
                out.counts[f"ingest answer {kind}"] += 1
                if kind == "error":
                    code, line = answer.get("code"), answer.get("line")
                    if not isinstance(code, str) or not isinstance(answer.get("message"), str) or not isinstance(line, int):
                        out.fail("ingest: malformed error line", short(raw))
                        continue
                    out.counts[f"ingest error {code}"] += 1
                    if code == "internal_error":
                        out.fail(
                            "ingest: internal_error (the gateway failed on a record)", f"{short(raw)} for input {input_of(line)}"
                        )
                elif kind == "synced":
                    if not isinstance(answer.get("accepted"), int) or not isinstance(answer.get("refused"), int):
                        out.fail("ingest: malformed synced line", short(raw))
                    event = waiting.pop(answer.get("id"), None) if isinstance(answer.get("id"), str) else None
                    if event is not None:
                        event.set()

        task = asyncio.create_task(read())

        async def answered(event: asyncio.Event) -> bool:
            waiter = asyncio.create_task(event.wait())
            done, _ = await asyncio.wait({waiter, task}, timeout=MARKER_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if waiter in done:
                return True
            if task not in done:
                out.fail("ingest: no answer to a marker sync (hang)", f"around line {line_no}")
            return False

        previous: asyncio.Event | None = None
        broken = False
        try:
            if rng.random() < 0.5:  # the optional auth line (no ingest.token here: answered `authed`)
                writer.write(b'{"auth":"any"}\n')
                line_no += 1
            while sent < count and not broken:
                parts = []
                for _ in range(min(INGEST_CHUNK, count - sent)):
                    data = draw(mutator, check)
                    lines = data.count(b"\n") + 1
                    recent.append((line_no + 1, line_no + lines, data))
                    line_no += lines
                    parts.append(data)
                    sent += 1
                    out.counts["ingest sent"] += 1
                marker = markers.new()
                event = waiting[marker] = asyncio.Event()
                parts.append(orjson.dumps({"sync": marker}))
                line_no += 1
                chunk = b"\n".join(parts) + b"\n"
                out.bytes_sent += len(chunk)
                writer.write(chunk)
                await writer.drain()
                if previous is not None and not await answered(previous):
                    broken = True
                previous = event
            if not broken and previous is not None and not await answered(previous):
                broken = True
        except OSError as exc:
            out.fail("ingest: write failed", repr(exc))
            broken = True
        if task.done():
            out.fail("ingest: connection closed by the gateway", f"around line {line_no}")
        writer.close()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.TimeoutError:
            task.cancel()


# -- long-poll -------------------------------------------------------------------------------------------


def odd_headers(rng: random.Random, tokens: Tokens, port: int) -> dict[str, bytes]:
    headers: dict[str, bytes] = {}
    for _ in range(rng.randint(1, 3)):
        roll = rng.randrange(6)
        if roll == 0:
            headers["Authorization"] = rng.choice(
                [
                    b"Bearer " + tokens.lp.encode(),
                    b"Bearer " + tokens.expired.encode(),
                    b"Bearer " + tokens.forged.encode(),
                    b"Bearer garbage",
                    b"Basic YWxhZGRpbjpvcGVuc2VzYW1l",
                    b"Bearer",
                    b"bearer  " + tokens.lp.encode(),
                    b"Bearer " + b"A" * 9000,
                    b"Bearer " + tokens.lp[:-2].encode(),
                    b"\xff\xfe",
                    b"Bearer \xe9\xe9",
                    b"Bearer " + tokens.lp.encode() + b" extra",
                ]
            )
        elif roll == 1:
            headers["Origin"] = rng.choice(
                [
                    b"http://evil.example",
                    b"null",
                    f"http://127.0.0.1:{port}".encode(),
                    b"garbage",
                    b"http://[::1",
                    b"https://127.0.0.1:99999",
                    b"http://127.0.0.1:%d/path" % port,
                    b"\xe9://x",
                    b"file://",
                ]
            )
        elif roll == 2:
            headers["Content-Type"] = rng.choice(
                [
                    b"text/plain",
                    b"application/json; charset=latin-1",
                    b"multipart/form-data; boundary=x",
                    b"\x80\x81",
                    b"a" * 2000,
                ]
            )
        elif roll == 3:
            name = "X-" + "".join(rng.choice("abcdefghij-") for _ in range(rng.randint(1, 30)))
            # (a field value starts and ends with a visible character: h11 refuses to send anything else)
            headers[name] = bytes(rng.choice(b"abc \t\x80\xff!~") for _ in range(rng.randint(0, 300))).strip(b" \t")
            if rng.random() < 0.05:  # a head over server.max_header_bytes: 431 headers_too_large
                headers[name] = b"p" * rng.randint(16_000, 40_000)
        elif roll == 4:
            headers["Accept-Encoding"] = rng.choice([b"gzip", b"br", b"*;q=0", b"identity;q=x"])
        else:
            # (a name not in server.allowed_hosts: 421 bad_host)
            headers["Host"] = rng.choice(
                [
                    b"evil.example",
                    b"127.0.0.1:%d" % port,
                    b"",
                    b"a" * 300,
                    b"localhost",
                    b"[::1]:80",
                    b"LOCALHOST.",
                    b"localhost.evil.example",
                ]
            )
    return headers


def check_http(out: Outcomes, prefix: str, response: httpx.Response, source: str) -> Any:
    """Count the status; fail on an undocumented answer. Returns the JSON body (None when there is none)."""
    status = response.status_code
    out.counts[f"{prefix} HTTP {status}"] += 1
    if status >= 500 and status not in HTTP_OK_ERRORS:
        out.fail(f"{prefix}: HTTP {status}", f"{short(response.content)} for {source}")
        return None
    if status == 204:
        return None
    try:
        body = response.json()
    except ValueError:
        out.fail(f"{prefix}: HTTP {status} body is not JSON", f"{short(response.content)} for {source}")
        return None
    if status >= 400:
        error = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(error, dict) and isinstance(error.get("code"), str) and isinstance(error.get("message"), str)):
            out.fail(f"{prefix}: HTTP {status} without an error object", f"{short(response.content)} for {source}")
            return None
        out.counts[f"{prefix} error {status} {error['code']}"] += 1
    return body


class LongPollBox:
    """The long-poll session the fuzzer posts to and the poller drains (recreated when it is closed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.session: str | None = None
        self.done = threading.Event()


def lp_poller(gw: Gateway, box: LongPollBox, out: Outcomes) -> None:
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        ack: int | None = None
        polled: str | None = None
        while not box.done.is_set():
            session = box.session
            if session is None:
                time.sleep(0.01)
                continue
            if session != polled:
                polled, ack = session, None
            try:
                response = http.get(f"/lp/{session}", params={} if ack is None else {"ack": ack})
            except httpx.HTTPError as exc:
                out.fail("longpoll: poll failed", repr(exc))
                continue
            body = check_http(out, "longpoll poll", response, "poll")
            if response.status_code == 404:
                with box.lock:
                    if box.session == session:
                        box.session = None
                continue
            if not isinstance(body, dict) or not isinstance(body.get("entries"), list):
                if response.status_code < 400:
                    out.fail("longpoll: poll body is not {batch, entries}", short(response.content))
                continue
            out.counts["longpoll polls"] += 1
            if body.get("batch") is not None:
                ack = body["batch"]
            for entry in count_entries(out, "longpoll", body["entries"], "long-poll"):
                if isinstance(entry, dict) and entry.get("code") == "closed":
                    out.counts[f"longpoll close {entry.get('close_code')}"] += 1
                    with box.lock:
                        if box.session == session:
                            box.session = None


def lp_worker(gw: Gateway, out: Outcomes, tokens: Tokens, name: str, count: int) -> None:
    rng = random.Random(f"{SEED}-{name}")
    mutator = Mutator(rng, command_corpus(tokens), COMMAND_FIELDS, FRAME_LIMIT)
    box = LongPollBox()
    poll_out = Outcomes()
    poller = threading.Thread(target=lp_poller, args=(gw, box, poll_out), name="lp-poller", daemon=True)
    poller.start()
    try:
        with web.Client(base_url=gw.http_url, timeout=10) as http:
            sent = 0
            carry: tuple[bytes, dict] | None = None
            while sent < count:
                try:
                    if box.session is None:
                        headers = {"Authorization": b"Bearer " + tokens.lp.encode()} if rng.random() < 0.5 else {}
                        response = http.post("/lp", headers=headers)  # type: ignore[arg-type]  # httpx takes str names with bytes values
                        body = check_http(out, "longpoll create", response, "session")
                        if response.status_code == 201:
                            box.session = body["session"]
                            out.counts["longpoll sessions"] += 1
                        else:
                            out.fail("longpoll: cannot create the session", short(response.content))
                            time.sleep(0.1)
                        continue
                    if carry is None and rng.random() < 0.2:  # session creation with odd headers
                        sent += 1
                        out.counts["longpoll inputs"] += 1
                        headers = odd_headers(rng, tokens, gw.http_port)
                        response = http.post("/lp", headers=headers, content=rng.choice([b"", b"{}", b"\xff" * 10]))  # type: ignore[arg-type]  # httpx takes str names with bytes values
                        source = f"POST /lp {short(repr(headers), 400)}"
                        body = check_http(out, "longpoll create", response, source)
                        if response.status_code == 201:
                            deleted = http.delete(f"/lp/{body['session']}")
                            check_http(out, "longpoll delete", deleted, source)
                        continue
                    if carry is None:
                        headers = odd_headers(rng, tokens, gw.http_port) if rng.random() < 0.1 else {}
                        headers.setdefault("Content-Type", b"application/json")
                        carry = (draw(mutator, names_honest), headers)
                    data, headers = carry
                    session = box.session
                    if session is None:  # closed meanwhile (e.g. 4009): the input goes to the next session
                        continue
                    carry = None
                    sent += 1
                    out.counts["longpoll inputs"] += 1
                    out.bytes_sent += len(data)
                    response = http.post(f"/lp/{session}", content=data, headers=headers)  # type: ignore[arg-type]  # httpx takes str names with bytes values
                    check_http(out, "longpoll post", response, f"{short(data, 600)} headers {short(repr(headers), 200)}")
                    if response.status_code == 404:
                        with box.lock:
                            if box.session == session:
                                box.session = None
                except httpx.HTTPError as exc:
                    out.fail("longpoll: request failed (hang or reset)", repr(exc))
    finally:
        box.done.set()
        poller.join(15)
        out.merge(poll_out)


# -- admin API -------------------------------------------------------------------------------------------


def admin_name(rng: random.Random) -> str:
    name = rng.choice(ADMIN_NAMES)
    if name and rng.random() < 0.3:
        chars = list(name)
        chars[rng.randrange(len(chars))] = rng.choice("abz.*/%?#\x00é ")
        name = "".join(chars)
    return name


def admin_worker(gw: Gateway, out: Outcomes, name: str, count: int) -> None:
    rng = random.Random(f"{SEED}-{name}")
    create = Mutator(rng, admin_create_corpus(), ADMIN_CREATE_FIELDS, FRAME_LIMIT)
    publish = Mutator(rng, admin_publish_corpus(), ADMIN_PUBLISH_FIELDS, FRAME_LIMIT)
    good = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        for _ in range(count):
            headers = good
            if rng.random() < 0.03:
                headers = {"Authorization": rng.choice(["Bearer wrong", "Basic x", "", f"Bearer {ADMIN_TOKEN}x"])}
            try:
                if rng.random() < 0.5:
                    data = draw(create, lambda d: names_honest(d, keys=("name",)))
                    path = "/api/topics"
                else:
                    data = draw(publish, names_honest)
                    topic = admin_name(rng)
                    while "honest" in topic.lower():
                        topic = admin_name(rng)
                    path = f"/api/topics/{quote(topic, safe='/' if rng.random() < 0.5 else '')}/publish"
                out.bytes_sent += len(data)
                out.counts["admin inputs"] += 1
                response = http.post(path, content=data, headers=headers)
                check_http(out, "admin", response, f"POST {path} {short(data, 600)}")
            except httpx.HTTPError as exc:
                out.fail("admin: request failed (hang or reset)", repr(exc))


# -- the run ---------------------------------------------------------------------------------------------


def run_fuzz(gw: Gateway, tokens: Tokens, counts: dict[str, int], phase: str) -> Outcomes:
    """All fuzzers at once: WebSocket and ingest on an asyncio loop here, long-poll and admin in threads."""
    results: dict[str, Outcomes] = {}
    threads = []
    for kind, target in (("longpoll", lp_worker), ("admin", admin_worker)):
        out = results[kind] = Outcomes()
        args = (
            (gw, out, tokens, f"{phase}-{kind}", counts[kind])
            if kind == "longpoll"
            else (gw, out, f"{phase}-{kind}", counts[kind])
        )
        thread = threading.Thread(target=target, args=args, name=f"fuzz-{kind}", daemon=True)
        thread.start()
        threads.append(thread)

    def split(total: int, parts: int) -> list[int]:
        return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]

    async def sockets() -> None:
        jobs = []
        for i, n in enumerate(split(counts["ws"], WS_CONNS)):
            out = results[f"ws{i}"] = Outcomes()
            jobs.append(ws_worker(gw, out, tokens, f"{phase}-ws{i}", n))
        for i, n in enumerate(split(counts["ingest"], INGEST_CONNS)):
            out = results[f"ingest{i}"] = Outcomes()
            jobs.append(ingest_worker(gw, out, f"{phase}-ingest{i}", n))
        out = results["ws-expiry"] = Outcomes()
        jobs.append(ws_expiry_worker(gw, out, EXPIRING[phase]))
        for i, n in enumerate(split(counts["ws-raw"], RAW_PARALLEL)):
            out = results[f"raw{i}"] = Outcomes()
            jobs.append(ws_raw_worker(gw, out, tokens, f"{phase}-raw{i}", n))
        await asyncio.gather(*jobs)

    asyncio.run(sockets())
    for thread in threads:
        thread.join(120)
        if thread.is_alive():
            results[thread.name] = Outcomes()
            results[thread.name].fail("fuzzer thread still running", thread.name)
    total = Outcomes()
    for out in results.values():
        total.merge(out)
    return total


LOG_ERROR = re.compile(rb"^(\S+ \S+ (ERROR|CRITICAL) |(ERROR|CRITICAL):|Traceback \(most recent call last\))", re.M)
LOG_WARNING = re.compile(rb"^\S+ \S+ WARNING (\S+): (bad input \((\w+)\))?", re.M)
PROJECT_FRAME = re.compile(r'^  File "(/[^"]*/(?:gateway|core)/[^"]+)", line (\d+), in (\S+)')


def log_findings(path: Path) -> tuple[list[str], collections.Counter[str], collections.Counter[str]]:
    """(the first ERROR/traceback excerpts, WARNING lines by logger and kind, tracebacks by exception and
    innermost gateway/core frame)."""
    text = path.read_bytes()
    lines = text.decode(errors="replace").splitlines()
    errors: list[str] = []
    for i, line in enumerate(lines):
        if not LOG_ERROR.match(line.encode()) or line.startswith("Traceback") or len(errors) >= 2:
            continue
        excerpt = [line]
        if i + 1 < len(lines) and lines[i + 1].startswith("Traceback"):
            for follow in lines[i + 1 :]:
                if follow.strip(" ^~"):
                    excerpt.append(follow)
                if follow and not follow.startswith((" ", "Traceback")):
                    break
        errors.append("\n".join(excerpt))
    errors_total = len(LOG_ERROR.findall(text))
    if errors_total > len(errors):
        errors.append(f"... {errors_total} ERROR/CRITICAL/Traceback lines in all")
    warnings = collections.Counter(
        f"{m.group(1).decode()} {m.group(2).decode() if m.group(2) else 'other'}" for m in LOG_WARNING.finditer(text)
    )
    tracebacks: collections.Counter[str] = collections.Counter()
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        frame = "?"
        for follow in lines[i + 1 :]:
            match = PROJECT_FRAME.match(follow)
            if match:
                where = Path(match.group(1))
                frame = f"{where.parent.name}/{where.name}:{match.group(2)} in {match.group(3)}"
            elif follow and not follow.startswith(" "):
                tracebacks[f"{follow[:160]} at {frame}"] += 1
                break
    return errors, warnings, tracebacks


@pytest.mark.timeout(180)
def test_fuzz_every_transport_of_one_gateway_process(tmp_path):
    started = time.monotonic()
    gw = Gateway(tmp_path)
    gw.start()
    sampler = RssSampler(gw)
    sampler.start()
    tokens = Tokens()
    problems: list[str] = []
    lines: list[str] = []
    honest: Honest | None = None
    try:
        honest = Honest(gw)
        warm = run_fuzz(gw, tokens, WARMUP, "warmup")
        time.sleep(0.2)  # the warm-up's closes settle
        baseline_samples = []
        for _ in range(3):
            baseline_samples.append(gw.rss_mb() or 0.0)
            time.sleep(0.05)
        baseline = statistics.median(baseline_samples)
        run_start = time.monotonic()
        out = run_fuzz(gw, tokens, COUNTS, "run")
        elapsed = time.monotonic() - run_start
        honest.finish()
        time.sleep(0.3)
        peak = sampler.peak_after(run_start)
        final = gw.rss_mb() or 0.0
        alive = gw.alive()
        health = None
        try:
            health = web.get(f"{gw.http_url}/healthz", timeout=5)
        except httpx.HTTPError as exc:
            problems.append(f"/healthz failed: {exc!r}")
        errors, warnings, tracebacks = log_findings(gw.log_path)

        sent = {
            "ws": out.counts["ws sent text"] + out.counts["ws sent binary"],
            "ws-raw": out.counts["ws-raw inputs"],
            "ingest": out.counts["ingest sent"],
            "longpoll": out.counts["longpoll inputs"],
            "admin": out.counts["admin inputs"],
        }
        lines.append(
            f"inputs sent per transport: {sent} = {sum(sent.values())} (and {sum(WARMUP.values())} in the warm-up round)"
        )
        lines.append(
            f"input bytes: {out.bytes_sent / 1e6:.1f} MB; fuzz run {elapsed:.1f} s, "
            f"whole test so far {time.monotonic() - started:.1f} s"
        )
        lines.append(
            f"RSS: baseline {baseline:.1f} MB after warm-up, peak {peak:.1f} MB "
            f"(+{peak - baseline:.1f} MB, bound +{RSS_BOUND_MB} MB), at the end {final:.1f} MB"
        )
        lines.append(
            f"honest: {honest.sent} published at {HONEST_RATE:g}/s, {honest.accepted} accepted, "
            f"{honest.received} received in order"
        )
        lines.append(f"gateway log: {dict(warnings)}")
        lines.append("outcomes:")
        lines += [f"  {key}: {value}" for key, value in sorted(out.counts.items())]
        if warm.failures:
            lines.append(f"warm-up failures: {dict(warm.failures)}")

        if sampler.killed is not None:
            problems.append(f"gateway killed: RSS {sampler.killed:.0f} MB above {RSS_KILL_MB} MB")
        if not alive:
            problems.append(f"gateway not alive at the end (exit {gw.proc.returncode if gw.proc else '?'})")
        if health is not None and (health.status_code != 200 or health.json() != {"status": "ok"}):
            problems.append(f"/healthz answered {health.status_code} {health.text[:200]}")
        if out.bytes_sent / 1e6 <= RSS_BOUND_MB:  # else a gateway keeping all it was sent could pass
            problems.append(f"only {out.bytes_sent / 1e6:.1f} MB of input, not above the RSS bound {RSS_BOUND_MB} MB")
        if peak > baseline + RSS_BOUND_MB:
            problems.append(f"RSS peak {peak:.1f} MB above baseline {baseline:.1f} + {RSS_BOUND_MB} MB")
        if errors:
            problems.append("gateway log has ERROR lines or tracebacks:\n" + "\n---\n".join(errors))
            problems.append(
                "tracebacks by exception and innermost gateway/core frame:\n"
                + "\n".join(f"  {n} x {what}" for what, n in tracebacks.most_common())
            )
        problems += [f"honest: {p}" for p in honest.problems]
        if honest.received != honest.accepted or honest.accepted != honest.sent or honest.sent < HONEST_RATE * 2:
            problems.append(f"honest: sent {honest.sent}, accepted {honest.accepted}, received {honest.received}")
        for result in (warm, out):
            for kind, n in sorted(result.failures.items()):
                problems.append(f"{kind}: {n} times, e.g.\n    " + "\n    ".join(result.samples[kind]))
        if sent != COUNTS:
            problems.append(f"not every input was sent: {sent}, planned {COUNTS}")
    finally:
        if honest is not None:
            honest.stop_publishing.set()
        sampler.stop_event.set()
        gw.stop()
    summary = "\n".join(lines)
    print("\n" + summary)
    if problems:
        print("\nPROBLEMS:\n" + "\n".join(problems))
    assert not problems, summary + "\n\nPROBLEMS:\n" + "\n".join(problems)
