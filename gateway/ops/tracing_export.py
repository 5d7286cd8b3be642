"""The SDK side of gateway/ops/tracing.py, imported only by `Tracing` (tracing on): what is exported, and how
much of a collector's answer is read.

- `RefusalFilter`, in front of the batch processor: a request the gateway refused (401, 403) exports nothing
  on its caller's say. A sampled `traceparent` is honoured once the request is accepted; a refused request
  that continued a caller's trace is dropped at its end, before it takes a place in the export queue (an
  unauthenticated caller cannot fill the queue and push out our spans). A refused request with no
  `traceparent` is sampled at `tracing.sample_rate`, like any other.
- `bounded_session`: the exporter's HTTP session, which reads at most EXPORT_ANSWER_MAX_BYTES of an answer
  (decoded), then closes the connection. The exporter only looks at the status; a collector (or whatever
  answers at its address) cannot make the gateway read, and hold, an answer of any size.
"""

from __future__ import annotations

import io
from typing import Any

import requests
import urllib3
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import SpanKind

#: bytes of an export's answer read (an OTLP answer is a few bytes: a partial-success note at most)
EXPORT_ANSWER_MAX_BYTES = 64 * 1024
#: the answers that refuse a request before it does anything (no token, a wrong one)
REFUSED_STATUSES = frozenset({401, 403})


class RefusalFilter(SpanProcessor):
    """Passes every ended span to `processor` but the server span of a refused request that continued a
    caller's trace (a remote parent): that one the caller asked for, and the gateway did not accept it."""

    def __init__(self, processor: SpanProcessor) -> None:
        self.processor = processor

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.processor.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if (
            span.kind is SpanKind.SERVER
            and span.parent is not None
            and span.parent.is_remote
            and (span.attributes or {}).get("http.response.status_code") in REFUSED_STATUSES
        ):
            return
        self.processor.on_end(span)

    def shutdown(self) -> None:
        self.processor.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.processor.force_flush(timeout_millis)


def bounded_session() -> requests.Session:
    """A requests session whose answers hold EXPORT_ANSWER_MAX_BYTES of body at most (a response hook, run
    before requests reads the body)."""
    session = requests.Session()
    session.hooks["response"].append(_bounded_answer)
    return session


def _bounded_answer(response: requests.Response, *args: Any, **kwargs: Any) -> requests.Response:
    raw = response.raw
    try:
        body = raw.read(EXPORT_ANSWER_MAX_BYTES + 1, decode_content=True)
    except (urllib3.exceptions.HTTPError, OSError):  # the status is in; a broken body changes nothing
        body = b""
        raw.close()
    if len(body) > EXPORT_ANSWER_MAX_BYTES:
        raw.close()  # the rest is never read: the connection goes with it
    raw.release_conn()  # read to its end: back to the pool (closed: dropped)
    response.raw = io.BytesIO(body[:EXPORT_ANSWER_MAX_BYTES])
    return response
