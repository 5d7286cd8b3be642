"""Tracing against what a caller sends and what a collector answers (hardening round 4, docs/operations.md
"Tracing"): a real gateway on loopback exporting to a real OTLP/HTTP receiver in this test, real HTTP requests.

- a refused request (401) exports nothing, whatever its `traceparent` says; an accepted one continues it;
- a collector's answer is read within EXPORT_ANSWER_MAX_BYTES, however long it is;
- oversized `traceparent` / `tracestate` headers are counted and logged at the bad-input rate, never by the
  propagator once per request;
- the receiver the package ships (`gateway trace-receiver`) shows a trace, as the docs say.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.testing import run_gateway
from loadtest.ports import free_port
from tests import web
from tests.gateway.gw_helpers import auth, wait_for
from tests.gateway.test_tracing import OtlpReceiver

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"  # sampled


@pytest.fixture
def fast_export() -> Iterator[None]:
    """The batch processor exports within 50 ms (the SDK reads its standard variable when a gateway starts)."""
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
    yield
    if saved is None:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
    else:
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    server.thread.start()
    yield server
    server.server.shutdown()


def test_a_refused_request_exports_no_span_on_its_callers_say(receiver: OtlpReceiver, fast_export: None) -> None:
    refused = [secrets.token_hex(16) for _ in range(40)]
    accepted = secrets.token_hex(16)
    # sample_rate 0: every span exported is one a caller's sampled traceparent asked for
    with (
        run_gateway(tracing={"otlp_endpoint": receiver.url, "sample_rate": 0.0}) as gw,
        web.Client(base_url=gw.http_url, timeout=10, trust_env=False) as http,
    ):
        for i, trace_id in enumerate(refused):
            if i % 2:  # the admin API
                answer = http.get("/api/topics", headers={"traceparent": traceparent(trace_id)})
            else:  # the Centrifugo server API
                answer = http.post(
                    "/api/publish",
                    json={"channel": "t", "data": 1},
                    headers={"traceparent": traceparent(trace_id), "X-API-Key": "wrong"},
                )
            assert answer.status_code == 401, answer.text
        answer = http.get("/api/topics", headers={**auth(gw), "traceparent": traceparent(accepted)})
        assert answer.status_code == 200
        # one exporter thread sends the spans in the order they ended: the refused ones would be in by now
        wait_for(lambda: [s for s in receiver.spans if s["trace_id"] == accepted], "the accepted request's span")
    assert [s for s in receiver.spans if s["trace_id"] in refused] == []
    [span] = [s for s in receiver.spans if s["trace_id"] == accepted]
    assert span["name"] == "admin list_topics" and span["attributes"]["http.response.status_code"] == 200


ANSWER_BYTES = 64 * 1024 * 1024


class LongAnswers:
    """An OTLP/HTTP collector that answers each export with 200 and ANSWER_BYTES of body, and counts the bytes
    the gateway let it write (the kernel's buffers take a few MiB of them whether the gateway reads or not)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(ANSWER_BYTES))
                self.end_headers()
                chunk, sent = b"\0" * 65536, 0
                try:
                    while sent < ANSWER_BYTES:
                        self.wfile.write(chunk)
                        sent += len(chunk)
                except OSError:  # the gateway closed the connection
                    pass
                collector.written.append(sent)
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_a_collectors_answer_is_read_within_a_bound(fast_export: None) -> None:
    collector = LongAnswers()
    try:
        with run_gateway(tracing={"otlp_endpoint": collector.url, "sample_rate": 1.0}) as gw:
            for exports in (1, 2):  # and the exporter still exports after a long answer
                assert web.get(f"{gw.http_url}/api/topics", headers=auth(gw), trust_env=False).status_code == 200
                wait_for(lambda: len(collector.written) >= exports, "an export answered", timeout=30)  # noqa: B023
    finally:
        collector.server.shutdown()
    # 64 KiB read (gateway/ops/tracing_export.py), then the connection closed: what the collector wrote
    # beyond is the loopback socket buffers' worth, never the whole answer
    assert max(collector.written) <= 16 * 1024 * 1024, collector.written


def test_oversized_trace_headers_are_counted_and_logged_at_a_bounded_rate(
    receiver: OtlpReceiver, fast_export: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    long_parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01-" + "x" * 600
    long_state = "k=" + "v" * 9000
    kept = secrets.token_hex(16)
    with (
        run_gateway(limits={"bad_input_log_per_s": 1.0}, tracing={"otlp_endpoint": receiver.url, "sample_rate": 0.0}) as gw,
        web.Client(base_url=gw.http_url, timeout=10, trust_env=False) as http,
    ):
        started = time.monotonic()
        for _ in range(30):
            assert http.get("/api/topics", headers={**auth(gw), "traceparent": long_parent}).status_code == 200
            assert (
                http.get(
                    "/api/topics", headers={**auth(gw), "traceparent": traceparent(kept), "tracestate": long_state}
                ).status_code
                == 200
            )
        elapsed = time.monotonic() - started
        metrics = http.get("/metrics").text
        # the caller's trace is still continued without its tracestate, as the propagator would
        wait_for(lambda: len([s for s in receiver.spans if s["trace_id"] == kept]) == 30, "the 30 continued spans")
    assert 'fanout_bad_input_total{source="http"} 60.0' in metrics
    propagator = [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert propagator == []
    lines = [r for r in caplog.records if r.name == "gateway.input"]
    # a burst of 1, then 1 a second
    assert 1 <= len(lines) <= 2 + elapsed, [r.getMessage() for r in lines]
    assert "traceparent header over 512 characters" in lines[0].getMessage()


def _receiver_block() -> list[str]:
    """The commands of docs/operations.md's "Seeing a trace without a collector", line continuations joined."""
    text = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"### Seeing a trace without a collector.*?```sh\n(.*?)```", text, re.S)
    assert block is not None
    return [line for line in block.group(1).replace("\\\n", " ").splitlines() if line.strip()]


FOUR = {"admin publish", "broker.publish", "engine.apply", "fanout"}


def test_the_documented_receiver_shows_a_publishs_trace(tmp_path: Path) -> None:
    receive, serve, publish = _receiver_block()
    assert receive.startswith(".venv/bin/gateway trace-receiver ")
    otlp, http = str(free_port()), str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))}
    receiver = subprocess.Popen(
        shlex.split(receive.replace("4318", otlp)), cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    ready = tmp_path / "ready.json"
    # the documented command, on free ports (the ingest's too), exporting at once rather than within 5 s
    served = {
        **env,
        "GATEWAY_SERVER_PORT": http,
        "GATEWAY_INGEST_PORT": "0",
        "GATEWAY_RAWTCP_ENABLED": "false",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    gateway = subprocess.Popen(
        ["bash", "-c", f"{serve.replace('4318', otlp)} --ready-file {ready}"],
        cwd=ROOT,
        env=served,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert "are printed here" in (receiver.stderr.readline() if receiver.stderr else "")
        wait_for(ready.exists, "the gateway's start", timeout=30)
        token = json.loads(ready.read_text())["admin_token"]
        done = subprocess.run(
            ["bash", "-c", publish.replace("127.0.0.1:8080", f"127.0.0.1:{http}")],
            env={**env, "TOKEN": token},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0 and '"seqs"' in done.stdout, done
        seen: dict[str, str] = {}
        assert receiver.stdout is not None
        while not FOUR <= seen.keys():  # the publish's spans, in the order they ended
            line = receiver.stdout.readline()
            assert line, "the receiver ended"
            name = re.match(r"trace \w+ span \w+ < [\w-]+ (.+?) \(", line)
            if name:
                seen[name.group(1)] = line
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=20)
        receiver.send_signal(signal.SIGINT)
        receiver.communicate(timeout=10)
    assert "url.path=/api/topics/news/publish http.response.status_code=200" in seen["admin publish"]
    assert "[fanout-gateway]" in seen["fanout"] and receiver.returncode == 0
