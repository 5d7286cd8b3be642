"""OpenTelemetry tracing ([tracing], gateway/ops/tracing.py): a real OTLP/HTTP receiver on loopback (decoding the
export requests with opentelemetry-proto), a real gateway exporting to it, real WebSocket clients, a real
hook backend and a real TCP ingest publisher; and, with tracing off, no OpenTelemetry SDK imported at all."""

from __future__ import annotations

import gzip
import json
import os
import secrets
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway import cli
from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, auth, recv_entries, send, wait_for, ws_connect
from tests.gateway.hook_backend import Backend

RULES = {"rules": [{"pattern": "*", "kind": "ring", "anonymous": True, "client_publish": True}]}


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    """POST /v1/traces: an OTLP/HTTP (protobuf) export request, decoded; its spans kept as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.receive(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def receive(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        {
                            "name": span.name,
                            "kind": span.kind,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "resource": resource,
                        }
                    )
        with self.lock:
            self.requests += 1
            self.spans += spans

    def named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [span for span in self.spans if span["name"] == name]

    def by_id(self, span_id: str) -> dict[str, Any] | None:
        with self.lock:
            return next((span for span in self.spans if span["span_id"] == span_id), None)

    def ancestors(self, span: dict[str, Any]) -> list[str]:
        """The names of the span's ancestors received, nearest first."""
        names = []
        parent = self.by_id(span["parent_id"])
        while parent is not None:
            names.append(parent["name"])
            parent = self.by_id(parent["parent_id"])
        return names


class HeaderBackend(Backend):
    """The hook backend (tests/gateway/hook_backend.py), also keeping each call's request headers."""

    def __init__(self) -> None:
        self.headers: dict[str, list[dict[str, str]]] = defaultdict(list)
        super().__init__()

    async def handle(self, request: Request) -> JSONResponse:
        self.headers[request.path_params["hook"]].append(dict(request.headers))
        return await super().handle(request)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    server.thread.start()
    yield server
    server.server.shutdown()


@pytest.fixture(scope="module")
def backend() -> Iterator[HeaderBackend]:
    server = HeaderBackend()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gw(receiver: OtlpReceiver, backend: HeaderBackend) -> Iterator[Any]:
    # the SDK's batch processor reads its delay from the standard variable: spans are exported within 50 ms
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
    try:
        with run_gateway(
            topics=RULES,
            proxy=backend.proxy("rpc"),
            tracing={"otlp_endpoint": receiver.url, "sample_rate": 1.0, "service_name": "gw-test"},
        ) as gw:
            yield gw
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


def _subscribed(ws: Any, topic: str) -> None:
    send(ws, op="subscribe", topic=topic, id=1)
    assert recv_entries(ws)[0]["type"] == "subscribed"


def test_an_admin_publish_continues_the_callers_trace_down_to_one_fanout_span(gw: Any, receiver: OtlpReceiver) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    with ws_connect(gw) as a, ws_connect(gw) as b, ws_connect(gw) as c:
        for ws in (a, b, c):
            _subscribed(ws, "traced.news")
        answer = web.post(
            f"{gw.http_url}/api/topics/traced.news/publish",
            json={"data": {"headline": "x" * 100}},
            headers={**auth(gw), "traceparent": f"00-{trace_id}-{parent_id}-01"},
            timeout=5,
        )
        assert answer.status_code == 200, answer.text
        frames = [ws.recv(timeout=5) for ws in (a, b, c)]
    sizes = [len(frame.encode() if isinstance(frame, str) else frame) for frame in frames]

    api = wait_for(lambda: [s for s in receiver.named("admin publish") if s["trace_id"] == trace_id], "the admin API span")[0]
    assert api["parent_id"] == parent_id  # a child of the caller's span
    assert api["attributes"]["http.request.method"] == "POST"
    assert api["attributes"]["http.response.status_code"] == 200
    assert api["resource"]["service.name"] == "gw-test"
    fanout = wait_for(lambda: [s for s in receiver.named("fanout") if s["trace_id"] == trace_id], "the fan-out span")
    assert len(fanout) == 1  # one span for the whole fan-out, never one per delivery
    attributes = fanout[0]["attributes"]
    assert attributes["fanout.subscribers"] == 3
    assert attributes["fanout.frames"] == 1
    assert attributes["fanout.bytes"] == sum(sizes)
    assert attributes["messaging.destination.name"] == "traced.news"
    # API -> broker -> applied -> fanned out
    assert receiver.ancestors(fanout[0]) == ["engine.apply", "broker.publish", "admin publish"]
    assert all(s["trace_id"] == trace_id for s in receiver.named("broker.publish") if s["parent_id"] == api["span_id"])


def test_a_publish_nobody_subscribes_to_ends_its_fanout_span_at_once(gw: Any, receiver: OtlpReceiver) -> None:
    trace_id = secrets.token_hex(16)
    answer = web.post(
        f"{gw.http_url}/api/topics/traced.empty/publish",
        json={"data": 1},
        headers={**auth(gw), "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
        timeout=5,
    )
    assert answer.status_code == 200, answer.text
    fanout = wait_for(lambda: [s for s in receiver.named("fanout") if s["trace_id"] == trace_id], "the fan-out span")
    assert fanout[0]["attributes"]["fanout.subscribers"] == 0
    assert gw.call(lambda: len(gw.hub.scheduler.fanouts)) == 0  # nothing left for the scheduler to watch


def test_a_hook_call_is_a_client_span_beneath_its_command_and_sends_traceparent(
    gw: Any, receiver: OtlpReceiver, backend: HeaderBackend
) -> None:
    backend.answers["rpc"] = lambda body: {"result": sum(body["params"])}
    with ws_connect(gw) as ws:
        send(ws, op="rpc", method="sum", params=[1, 2, 3], id=7)
        assert recv_entries(ws) == [{"type": "reply", "id": 7, "result": 6}]
    traceparent = backend.headers["rpc"][-1]["traceparent"]
    _version, trace_id, span_id, _flags = traceparent.split("-")
    hook = wait_for(lambda: [s for s in receiver.named("hook rpc") if s["span_id"] == span_id], "the hook span")[0]
    assert hook["trace_id"] == trace_id
    assert hook["kind"] == 3  # SPAN_KIND_CLIENT
    assert hook["attributes"]["fanout.hook.outcome"] == "ok"
    assert hook["attributes"]["url.full"] == backend.url("rpc")
    command = receiver.by_id(hook["parent_id"])
    assert command is not None and command["name"] == "command rpc"
    assert command["attributes"]["fanout.client"]


def test_an_ingest_batch_is_one_span_with_its_record_count(gw: Any, receiver: OtlpReceiver) -> None:
    publisher = Ingest(gw)
    try:
        for seq in range(5):
            publisher.send({"topic": "traced.ingest", "data": seq})
        assert publisher.sync(1)["accepted"] == 5
    finally:
        publisher.close()
    spans = wait_for(
        lambda: [s for s in receiver.named("ingest batch") if s["attributes"].get("fanout.ingest.accepted")],
        "the ingest batch span",
    )
    assert sum(s["attributes"]["fanout.ingest.accepted"] for s in spans) == 5
    assert all(s["parent_id"] == "" for s in spans)  # each batch starts its trace


OFF_PROBE = """
import sys, httpx
from gateway.ops.tracing import NO_TRACING
from gateway.testing import run_gateway
with run_gateway(topics={"rules": [{"pattern": "*", "kind": "ring", "anonymous": True}]}) as gw:
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    answer = httpx.post(gw.http_url + "/api/topics/t/publish", json={"data": 1},
                        headers={"Authorization": "Bearer " + gw.admin_token, "traceparent": traceparent})
    assert answer.status_code == 200, answer.text
    assert gw.hub.tracing is NO_TRACING
print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))
"""


def test_with_tracing_off_no_opentelemetry_module_is_imported() -> None:
    done = subprocess.run(
        [sys.executable, "-c", OFF_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def check_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str]
) -> tuple[int, str, str]:
    """`gateway check-config` (gateway.cli.main, in this process: it starts nothing) with only `env`'s GATEWAY_*
    variables: its status, stdout and stderr. The command as a program: test_config_cli.py, test_tracing_extra.py."""
    for name in [k for k in os.environ if k.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    status = cli.main(["check-config"])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize(
    "variable, value, says",
    [
        ("GATEWAY_TRACING_SAMPLE_RATE", "1.5", "tracing.sample_rate must be in [0, 1]"),
        ("GATEWAY_TRACING_OTLP_ENDPOINT", "collector:4318", "tracing.otlp_endpoint must be an http:// or https:// URL"),
        ("GATEWAY_TRACING_SERVICE_NAME", " ", "tracing.service_name must not be empty"),
    ],
)
def test_check_config_refuses_a_bad_tracing_setting(monkeypatch, capsys, variable: str, value: str, says: str) -> None:
    status, _out, err = check_config(monkeypatch, capsys, {variable: value})
    assert status == 2
    assert says in err


def test_check_config_shows_the_tracing_settings_in_force(monkeypatch, capsys) -> None:
    env = {"GATEWAY_TRACING_OTLP_ENDPOINT": "http://collector.example:4318", "GATEWAY_TRACING_SAMPLE_RATE": "0.5"}
    status, out, err = check_config(monkeypatch, capsys, env)
    assert status == 0, err
    assert json.loads(out)["tracing"] == {
        "otlp_endpoint": "http://collector.example:4318",
        "service_name": "fanout-gateway",
        "sample_rate": 0.5,
    }


class KeySet:
    """A JWKS endpoint on loopback publishing one EC key (`kid` "k1")."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric import ec
        from jwt.algorithms import ECAlgorithm

        self.private = ec.generate_private_key(ec.SECP256R1())
        body = json.dumps(
            {"keys": [{**ECAlgorithm.to_jwk(self.private.public_key(), as_dict=True), "kid": "k1", "use": "sig", "alg": "ES256"}]}
        ).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/certs"


def test_a_token_checked_against_the_jwks_key_set_is_a_span(receiver: OtlpReceiver) -> None:
    import time

    import jwt

    keys = KeySet()
    token = jwt.encode(
        {"sub": "jwks-user", "exp": int(time.time()) + 600}, keys.private, algorithm="ES256", headers={"kid": "k1"}
    )
    try:
        with run_gateway(
            topics=RULES, auth={"jwks_url": keys.url}, tracing={"otlp_endpoint": receiver.url, "sample_rate": 1.0}
        ) as gw:
            with ws_connect(gw, query=f"?token={token}") as ws:
                send(ws, op="rpc", method="whoami", id=1)
                assert recv_entries(ws)[0]["result"]["user"] == "jwks-user"
            # the exporter flushes at the gateway's stop at the latest
    finally:
        keys.server.shutdown()
    spans = wait_for(
        lambda: [s for s in receiver.named("auth.verify") if s["attributes"]["fanout.auth.kid"] == "k1"], "the token check span"
    )
    assert spans[0]["attributes"]["fanout.auth.alg"] == "ES256"
