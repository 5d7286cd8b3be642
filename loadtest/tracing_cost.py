"""What tracing ([tracing], gateway/ops/tracing.py) costs, site by site, in-process; and a discarding OTLP receiver.

    .venv/bin/python -m loadtest.tracing_cost               # per-site costs at sample_rate 0.01 and 1.0
    .venv/bin/python -m loadtest.tracing_cost --sink 14318  # an OTLP/HTTP receiver on 127.0.0.1 that drops all

The sink is what the load runs with tracing on export to (docs/benchmarks.md, the tracing rows): it answers
200 to every POST and keeps nothing, so the figures measure the gateway, not a collector.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from core import Batch
from core.entries import encode_message
from gateway.config import TracingConfig
from gateway.ops.tracing import Fanout, OtlpTracing, count_fanouts

SUBSCRIBERS = 1000


def per_call_ns(fn: Callable[[], Any], calls: int) -> float:
    """The best of 5 timings of `calls` calls, in ns per call."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e9


class _NoSpan:
    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def end(self) -> None:
        pass


def span_costs(rate: float, endpoint: str) -> None:
    tracing = OtlpTracing(TracingConfig(endpoint, "tracing-cost", rate), "bench")
    attributes = {"fanout.ingest.lines": 5, "fanout.ingest.bytes": 500, "fanout.ingest.accepted": 5, "fanout.ingest.errors": 0}

    def ingest_turn() -> None:
        tracing.record("ingest batch", time.time_ns(), attributes)

    def admin_request() -> None:
        with tracing.server_span("admin publish", {}, {"http.request.method": "POST", "url.path": "/api/topics/t/publish"}):
            if tracing.recording():
                with tracing.span("broker.publish", {"messaging.destination.name": "t", "fanout.messages": 1}):
                    tracing.expect_apply()

    print(
        f"sample_rate {rate}: an ingest turn's span {per_call_ns(ingest_turn, 20000):,.0f} ns, "
        f"an admin publish's spans {per_call_ns(admin_request, 20000):,.0f} ns"
    )
    tracing.provider.shutdown()


def fanout_costs() -> None:
    entry = encode_message("hot0000", 41, {"ts": 1, "pad": "x" * 43})
    older = encode_message("hot0000", 40, {"ts": 1, "pad": "x" * 43})
    carrying = [Batch(f"c{i}", [entry], len(entry)) for i in range(SUBSCRIBERS)]
    others = [Batch(f"c{i}", [older], len(older)) for i in range(SUBSCRIBERS)]
    watched = {"hot0000": Fanout(_NoSpan(), "hot0000", 41, SUBSCRIBERS, float("inf"))}  # type: ignore[arg-type]
    for what, batches in (("carrying the watched message", carrying), ("not carrying it", others)):
        cost = per_call_ns(functools.partial(count_fanouts, watched, batches), 200) / SUBSCRIBERS
        print(f"a watched fan-out, per batch {what}: {cost:,.0f} ns")


def sink(port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    print(f"discarding OTLP/HTTP receiver on http://127.0.0.1:{port}")
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sink", type=int, metavar="PORT", help="run a discarding OTLP/HTTP receiver instead")
    parser.add_argument(
        "--endpoint",
        default="http://127.0.0.1:14318",
        help="where the measured tracer exports (run a --sink there, or its spans are dropped)",
    )
    args = parser.parse_args()
    if args.sink is not None:
        sink(args.sink)
        return
    for rate in (0.01, 1.0):
        span_costs(rate, args.endpoint)
    fanout_costs()


if __name__ == "__main__":
    main()
