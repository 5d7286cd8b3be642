"""OpenTelemetry traces (`[tracing]`, docs/operations.md "Tracing"), exported over OTLP/HTTP.

The hub always holds a `Tracing`. Off (`tracing.otlp_endpoint` empty, the default) it is `NO_TRACING`, a
null object, and nothing of OpenTelemetry is imported, not even its API: its spans are one shared no-op
context (no span object is made), an admin request is answered as if untraced, `recording()` is False, and
the ingest's per-turn bookkeeping is skipped on `enabled`; the scheduler's side costs an empty dict
(`traced_applies` per publish, `fanouts` per cycle). On, it is `OtlpTracing`, the only place the SDK is imported.

On: one tracer provider per hub (never the process-global one: tests run several gateways in one process),
a `ParentBased(TraceIdRatioBased(sample_rate))` sampler (a request's `traceparent` keeps its caller's
decision, once the request is accepted: a refused one exports nothing on its caller's say), a batch span
processor exporting from its own thread (the OTEL_BSP_* variables tune it) and the OTLP/HTTP exporter
(OTEL_EXPORTER_OTLP_* variables: headers, certificates, compression), reading 64 KiB of a collector's answer
at most (gateway/ops/tracing_export.py). A `traceparent` over 512 characters or a `tracestate` over 8,192 is
ignored, as the propagator would, but counted and logged as bad input (`fanout_bad_input_total{source="http"}`,
at `limits.bad_input_log_per_s`), not by the propagator once per request.

The spans:

    admin <endpoint> (server)     every admin API request; an incoming `traceparent` continues that trace
      broker.publish              a publish's messages through the broker, until their seqs are known
        engine.apply              the engine accepting the publish's last message
          fanout                  from that apply until the subscribers the topic had then got it: ONE span
                                  (fanout.subscribers, fanout.frames, fanout.bytes), never one per delivery
    ingest batch                  one processing turn of a TCP ingest connection (its records), a trace root
    command <hook>                a client command that waits for a backend hook, a trace root,
      hook <hook> (client)        and its HTTP call, which sends `traceparent` to the backend
    auth.verify                   a token checked against the JWKS key set ([auth] jwks_url)

The fan-out is followed without touching a delivery: while a sampled publish's fan-out is watched, each
scheduler cycle's batches are scanned once for its message entry (`count_fanouts`); the watch ends when
every subscriber the topic had at the apply got it, or FANOUT_WAIT_S after the apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from core import Batch
from core.entries import encode_message

from ..config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span
    from starlette.requests import Request
    from starlette.responses import Response

#: a traced publish's fan-out is watched this long at most: subscribers still behind then are not waited for
FANOUT_WAIT_S = 1.0
#: a traced publish whose apply does not come (refused, or a broker that applies it on other nodes only) is
#: forgotten this long after it was sent
APPLY_WAIT_S = 10.0
#: traced publishes followed at once (their applies expected plus their fan-outs watched); beyond, a sampled
#: publish still gets its admin and broker spans, not the ones below
MAX_WATCHED = 64
#: what the OTLP/HTTP trace export is POSTed to, below the collector's base URL
TRACES_PATH = "/v1/traces"
#: the W3C trace context headers' lengths beyond which the propagator ignores them (and would log a warning)
TRACEPARENT_MAX_CHARS = 512
TRACESTATE_MAX_CHARS = 8192


def traces_url(endpoint: str) -> str:
    """The export URL: `tracing.otlp_endpoint` with /v1/traces appended unless it already ends with it."""
    base = endpoint.rstrip("/")
    return base if urlsplit(base).path.endswith(TRACES_PATH) else base + TRACES_PATH


def redacted(url: str) -> str:
    """`url` without its user name and password, as a span attribute may show it."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"REDACTED:REDACTED@{host}").geturl()


def from_config(config: TracingConfig, instance_id: str) -> Tracing:
    """The hub's tracing: `NO_TRACING` when `otlp_endpoint` is empty (then nothing is imported)."""
    return OtlpTracing(config, instance_id) if config.otlp_endpoint else NO_TRACING


async def traced_answer(
    tracing: Tracing, name: str, request: Request, answer: Callable[[Request], Awaitable[Response]]
) -> Response:
    """An HTTP API request's answer, in its server span when tracing is on (a child of the caller's span when
    it sends `traceparent`), with the method, path and status as attributes."""
    return await tracing.answer(name, request, answer)


class TraceSpan(Protocol):
    """What the call sites do with a span (an OpenTelemetry `Span`, or `NO_SPAN` with tracing off)."""

    def set_attribute(self, key: str, value: Any) -> None: ...

    def set_status(self, status: Any, description: str | None = None) -> None: ...


class Tracing(Protocol):
    """The hub's tracing: `OtlpTracing` when on, else `NoTracing` (every call a no-op, no span made)."""

    #: whether spans are made at all: a hot path skips the bookkeeping of a span it would not make
    enabled: bool

    async def answer(self, name: str, request: Request, answer: Callable[[Request], Awaitable[Response]]) -> Response:
        """`answer(request)`, in a server span named `name` (`traced_answer`)."""
        ...

    def span(
        self,
        name: str,
        attributes: dict[str, Any] | None = None,
    ) -> contextlib.AbstractContextManager[TraceSpan]:
        """A span beneath the current one (a new trace when there is none), current within the block."""
        ...

    def root_span(self, name: str, attributes: dict[str, Any]) -> contextlib.AbstractContextManager[TraceSpan]:
        """The root of a new trace, whatever is current (a client's command, ...)."""
        ...

    def client_span(
        self,
        name: str,
        headers: dict[str, str],
        attributes: dict[str, Any],
    ) -> contextlib.AbstractContextManager[TraceSpan]:
        """An outgoing call's span beneath the current one; `headers` get its `traceparent`."""
        ...

    def record(self, name: str, started_ns: int, attributes: dict[str, Any]) -> None:
        """A finished span, started at `started_ns` (time.time_ns) and ending now, the root of a new trace."""
        ...

    def ok(self, span: TraceSpan) -> None:
        """The span's work was answered as designed (a backend's refusal): not an error."""
        ...

    def recording(self) -> bool:
        """Whether the current span is sampled (its children would be)."""
        ...

    def expect_apply(self) -> ExpectedApply | None:
        """What the next apply of a publish sent now continues (None: not sampled)."""
        ...

    async def close(self) -> None:
        """Export what is left and stop exporting (at most 3 s, off the event loop)."""
        ...


class _NoSpan:
    """Tracing off: the one span every block gets, doing nothing; its own context manager, so entering a
    block makes no object."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_status(self, status: Any, description: str | None = None) -> None:
        return None


NO_SPAN = _NoSpan()


class NoTracing:
    """Tracing off (`[tracing]` without `otlp_endpoint`): a null object, nothing of OpenTelemetry imported."""

    __slots__ = ()
    enabled = False

    async def answer(self, name: str, request: Request, answer: Callable[[Request], Awaitable[Response]]) -> Response:
        return await answer(request)

    def span(self, name: str, attributes: dict[str, Any] | None = None) -> _NoSpan:
        return NO_SPAN

    def root_span(self, name: str, attributes: dict[str, Any]) -> _NoSpan:
        return NO_SPAN

    def client_span(self, name: str, headers: dict[str, str], attributes: dict[str, Any]) -> _NoSpan:
        return NO_SPAN

    def record(self, name: str, started_ns: int, attributes: dict[str, Any]) -> None:
        return None

    def ok(self, span: TraceSpan) -> None:
        return None

    def recording(self) -> bool:
        return False

    def expect_apply(self) -> ExpectedApply | None:
        return None

    async def close(self) -> None:
        return None


NO_TRACING = NoTracing()


class OtlpTracing:
    """An enabled tracer and the helpers the call sites use (the only place the SDK is imported)."""

    enabled = True

    def __init__(self, config: TracingConfig, instance_id: str) -> None:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from .tracing_export import RefusalFilter, bounded_session

        self._context = context
        #: the OpenTelemetry trace API module
        self.api = trace
        self._kinds = trace.SpanKind
        self.propagator = TraceContextTextMapPropagator()
        resource = Resource.create({"service.name": config.service_name, "service.instance.id": instance_id})
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_rate)), resource=resource, shutdown_on_exit=False
        )
        exporter = OTLPSpanExporter(endpoint=traces_url(config.otlp_endpoint), session=bounded_session())
        self.provider.add_span_processor(RefusalFilter(BatchSpanProcessor(exporter)))
        self.tracer = self.provider.get_tracer("fanout-gateway")

    # -- spans ---------------------------------------------------------------------------------------------

    async def answer(self, name: str, request: Request, answer: Callable[[Request], Awaitable[Response]]) -> Response:
        peer = request.client.host if request.client else "?"

        def oversized(header: str, limit: int) -> None:
            request.app.state.hub.bad_input("http", "%s header over %d characters: ignored", header, limit, peer=peer)

        with self.server_span(
            name, request.headers, {"http.request.method": request.method, "url.path": request.url.path}, oversized
        ) as span:
            response = await answer(request)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    def server_span(
        self,
        name: str,
        headers: Mapping[str, str],
        attributes: dict[str, Any],
        oversized: Callable[[str, int], None] = lambda header, limit: None,
    ) -> contextlib.AbstractContextManager[Span]:
        """A request's span, current while the request runs: a child of the caller's span when `headers`
        carry a W3C `traceparent`, else the root of a new trace. A header too long is left out (as the
        propagator would) and reported to `oversized(header, limit)` instead of the propagator's log."""
        parent = self.propagator.extract(_trace_headers(headers, oversized))
        return self.tracer.start_as_current_span(name, context=parent, kind=self._kinds.SERVER, attributes=attributes)

    def span(self, name: str, attributes: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[Span]:
        """A span beneath the current one (a new trace when there is none), current within the block."""
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def root_span(self, name: str, attributes: dict[str, Any]) -> contextlib.AbstractContextManager[Span]:
        """The root of a new trace, whatever is current (a client's command, ...)."""
        return self.tracer.start_as_current_span(name, context=self._context.Context(), attributes=attributes)

    @contextlib.contextmanager
    def client_span(self, name: str, headers: dict[str, str], attributes: dict[str, Any]) -> Iterator[Span]:
        """An outgoing call's span beneath the current one; `headers` get its `traceparent`."""
        with self.tracer.start_as_current_span(name, kind=self._kinds.CLIENT, attributes=attributes) as span:
            self.propagator.inject(headers)
            yield span

    def record(self, name: str, started_ns: int, attributes: dict[str, Any]) -> None:
        """A finished span, started at `started_ns` (time.time_ns) and ending now, the root of a new trace:
        made after the fact, so work that turns out empty makes none."""
        self.tracer.start_span(name, context=self._context.Context(), start_time=started_ns, attributes=attributes).end()

    def ok(self, span: TraceSpan) -> None:
        """The span's work was answered as designed (a backend's refusal): not an error."""
        span.set_status(self.api.Status(self.api.StatusCode.OK))

    def recording(self) -> bool:
        """Whether the current span is sampled (its children would be)."""
        return self.api.get_current_span().is_recording()

    def expect_apply(self) -> ExpectedApply | None:
        """What the next apply of a publish sent now continues: the current span (None: not sampled)."""
        current = self.api.get_current_span()
        if not current.is_recording():
            return None
        return ExpectedApply(self, self._context.get_current(), time.monotonic() + APPLY_WAIT_S)

    def shutdown(self) -> None:
        """Export what is left (at most 2 s) and stop the exporter's thread. Blocking: run it in a thread."""
        self.provider.force_flush(2000)
        self.provider.shutdown()

    async def close(self) -> None:
        # the spans left are exported off the event loop; a dead collector: 3 s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                await asyncio.to_thread(self.shutdown)


def _trace_headers(headers: Mapping[str, str], oversized: Callable[[str, int], None]) -> dict[str, str]:
    """The trace context headers the propagator may read: those within its length limits."""
    carrier: dict[str, str] = {}
    parent = headers.get("traceparent")
    if parent is None:
        return carrier
    if len(parent) > TRACEPARENT_MAX_CHARS:
        oversized("traceparent", TRACEPARENT_MAX_CHARS)
        return carrier
    carrier["traceparent"] = parent
    state = headers.get("tracestate")
    if state is not None:
        if len(state) > TRACESTATE_MAX_CHARS:
            oversized("tracestate", TRACESTATE_MAX_CHARS)
        else:
            carrier["tracestate"] = state
    return carrier


# -- a traced publish's apply and fan-out (the scheduler's side) ------------------------------------------


class ExpectedApply:
    """A sampled admin publish sent to the broker: its apply on this node is `engine.apply`'s span."""

    __slots__ = ("tracing", "context", "deadline")

    def __init__(self, tracing: OtlpTracing, context: Context, deadline: float) -> None:
        self.tracing = tracing
        self.context = context
        self.deadline = deadline

    def span(self, topic: str) -> contextlib.AbstractContextManager[Span]:
        return self.tracing.tracer.start_as_current_span(
            "engine.apply", context=self.context, attributes={"messaging.destination.name": topic}
        )

    def watch(self, span: Span, topic: str, seq: int, subscribers: int) -> Fanout:
        """The fan-out span of the message the engine accepted as `seq`, beneath its apply span."""
        fanout_span = self.tracing.tracer.start_span(
            "fanout",
            context=self.tracing.api.set_span_in_context(span),
            attributes={"messaging.destination.name": topic, "fanout.seq": seq, "fanout.expected": subscribers},
        )
        return Fanout(fanout_span, topic, seq, subscribers, time.monotonic() + FANOUT_WAIT_S)


class Fanout:
    """A traced message's fan-out being watched: who got it so far, in how many distinct frames, how many bytes."""

    __slots__ = ("span", "prefix", "expected", "subscribers", "frames", "bytes", "deadline", "keys")

    def __init__(self, span: Span, topic: str, seq: int, expected: int, deadline: float) -> None:
        self.span = span
        entry = encode_message(topic, seq, None)
        #: the start of the message's entry, which names its topic and seq (the data follows)
        self.prefix = entry[: entry.rindex(b'"data":')]
        self.expected = expected
        self.subscribers = 0
        self.frames = 0
        self.bytes = 0
        self.deadline = deadline
        #: the distinct frames carrying it in the current cycle (the scheduler frames each once per cycle)
        self.keys: set[bytes | tuple[bytes, ...]] = set()

    def delivered(self, entries: list[bytes]) -> None:
        self.subscribers += 1
        # the frame: "[" + ",".join(entries) + "]" (core.entries.frame_batch), as the transports get it
        key: bytes | tuple[bytes, ...]
        if len(entries) == 1:
            key = entries[0]
            self.bytes += len(key) + 2
        else:
            key = tuple(entries)
            self.bytes += sum(map(len, entries)) + len(entries) + 1
        if key not in self.keys:
            self.keys.add(key)
            self.frames += 1

    def end(self, complete: bool) -> None:
        self.span.set_attributes(
            {
                "fanout.subscribers": self.subscribers,
                "fanout.frames": self.frames,
                "fanout.bytes": self.bytes,
                "fanout.complete": complete,
            }
        )
        self.span.end()


def count_fanouts(fanouts: Mapping[str, Fanout], batches: Iterable[Batch]) -> None:
    """One cycle's batches, scanned for the watched messages' entries. Only called while a fan-out is watched:
    O(entries of the cycle): a dict lookup per entry (the subscribers of a topic share its entry object, whose
    hash is cached), and a prefix check per distinct entry of the cycle."""
    watched = list(fanouts.values())
    for fanout in watched:
        fanout.keys.clear()
    found: dict[bytes, Fanout | None] = {}
    for batch in batches:
        entries = batch.entries
        for entry in entries:
            watch = found.get(entry, _UNSEEN)
            if watch is _UNSEEN:
                watch = found[entry] = _watching(entry, watched)
            if watch is not None:
                watch.delivered(entries)


#: `count_fanouts`'s mark of an entry not looked at yet this cycle
_UNSEEN: Any = object()


def _watching(entry: bytes, watched: list[Fanout]) -> Fanout | None:
    """The watched fan-out whose message `entry` is, if any."""
    for fanout in watched:
        if entry.startswith(fanout.prefix):
            return fanout
    return None


def end_fanouts(fanouts: dict[str, Fanout], now: float) -> None:
    """End the watches whose subscribers all got the message, and those past their deadline."""
    for topic, fanout in list(fanouts.items()):
        if fanout.subscribers >= fanout.expected or now >= fanout.deadline:
            del fanouts[topic]
            fanout.end(fanout.subscribers >= fanout.expected)


def forget_applies(expected: dict[str, ExpectedApply], now: float) -> None:
    """Drop the expected applies that never came."""
    for topic, apply in list(expected.items()):
        if now >= apply.deadline:
            del expected[topic]
