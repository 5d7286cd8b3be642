"""A trace receiver for development: `python -m gateway.ops.trace_receiver [--host H] [--port P]` takes the
gateway's OTLP/HTTP exports (POST /v1/traces, protobuf, plain, gzip or deflate) and prints each span on
stdout, one a line, so a trace can be seen with what the package ships, no collector, no container
(docs/operations.md, "Seeing a trace without a collector"). It keeps nothing: each export is printed and
forgotten. Not for production: one process, no storage, no search.

    trace 4bf92f3577b34da6a3ce929d0e0e4736 span 00f067aa0ba902b7 < 53995c3f42cd8ad8 admin publish (server) 1.84 ms
        [fanout-gateway] http.request.method=POST url.path=/api/topics/news/publish http.response.status_code=200

(one line; `<` names the parent span, `-` for a trace's root). Bounds: an export request of at most
MAX_REQUEST_BYTES, compressed and decoded (else 413, nothing printed); a span's attribute value is shown up to
MAX_VALUE_CHARS characters, its control characters escaped (a span attribute may hold a client's text).
"""

from __future__ import annotations

import argparse
import sys
import threading
import zlib
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .logformat import escape

#: an export request's body, before and after decompression (the SDK sends 512 spans a request: ~0.2 MiB)
MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: characters of an attribute value printed
MAX_VALUE_CHARS = 200
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_print_lock = threading.Lock()


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _shown(value: Any) -> str:
    text = str(value)
    return escape(text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "...")


def span_lines(body: bytes) -> list[str]:
    """The lines of one export request's spans (an ExportTraceServiceRequest, protobuf)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    lines = []
    for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = _shown(resource.get("service.name", "?"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                parent = span.parent_span_id.hex() or "-"
                took_ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
                attributes = " ".join(f"{escape(a.key)}={_shown(_value(a.value))}" for a in span.attributes)
                lines.append(
                    f"trace {span.trace_id.hex()} span {span.span_id.hex()} < {parent} {_shown(span.name)} "
                    f"({KINDS.get(span.kind, 'unspecified')}) {took_ms:.2f} ms [{service}] {attributes}".rstrip()
                )
    return lines


def _decoded(body: bytes, encoding: str) -> bytes | None:
    """The body without its content encoding; None when it is unknown, broken or decodes beyond the bound."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        return None
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, MAX_REQUEST_BYTES)
    except zlib.error:
        return None
    return None if inflater.unconsumed_tail or not inflater.eof else out


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # seconds a connection may stay silent (a stalled sender holds a thread no longer)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") != "/v1/traces":
            return self._answer(404)
        try:
            length = int(self.headers.get("content-length", ""))
        except ValueError:
            return self._answer(411)
        if not 0 <= length <= MAX_REQUEST_BYTES:
            self.close_connection = True  # the body is not read
            return self._answer(413)
        body = _decoded(self.rfile.read(length), self.headers.get("content-encoding", "").strip().lower())
        if body is None:
            return self._answer(415)
        try:
            lines = span_lines(body)
        except Exception:  # a body that is not an export request: the sender's mistake
            return self._answer(400)
        with _print_lock:
            for line in lines:
                print(line, flush=True)
        self._answer(200)

    def _answer(self, status: int) -> None:
        # an empty ExportTraceServiceResponse is an empty protobuf message: no body
        self.send_response(status)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # stdout is for the spans


def receive(host: str, port: int) -> int:
    """Print the spans POSTed to `host:port` until interrupted (`gateway trace-receiver`); 2 when it cannot listen
    or the `tracing` extra, which reads the exports, is not installed."""
    try:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: F401 - what reads each export
    except ImportError:
        print(
            "trace receiver: needs opentelemetry-proto, which the tracing extra installs: "
            "pip install 'fanout-gateway[tracing]' (in a checkout, `make setup` installs every extra)",
            file=sys.stderr,
        )
        return 2
    try:
        server = ThreadingHTTPServer((host, port), _Handler)
    except OSError as exc:
        print(f"trace receiver: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    print(
        f"trace receiver: spans POSTed to http://{host}:{server.server_address[1]}/v1/traces are printed here",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.ops.trace_receiver", description="print the spans a gateway exports over OTLP/HTTP, one a line"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=4318, help="the port to listen on (default 4318, OTLP/HTTP's)")
    args = parser.parse_args(argv)
    return receive(args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
