"""Tracing off is a null object (gateway/ops/tracing.py `NoTracing`): every call site calls it unguarded, so it
must answer as the untraced code did and make nothing per call: no span, no context manager."""

from __future__ import annotations

import asyncio

from gateway.config import TracingConfig
from gateway.ops.tracing import NO_SPAN, NO_TRACING, from_config, traced_answer


def test_an_empty_endpoint_gives_the_null_object() -> None:
    assert from_config(TracingConfig(otlp_endpoint="", service_name="gw", sample_rate=1.0), "node-1") is NO_TRACING
    assert NO_TRACING.enabled is False
    assert not NO_TRACING.recording()
    assert NO_TRACING.expect_apply() is None


def test_every_span_of_the_null_object_is_the_one_shared_no_op_span() -> None:
    headers = {"content-type": "application/json"}
    blocks = [NO_TRACING.span("s"), NO_TRACING.root_span("r", {"a": 1}), NO_TRACING.client_span("c", headers, {"a": 1})]
    for block in blocks:
        assert block is NO_SPAN  # the block's context manager is the span itself: nothing made per call
        with block as span:
            assert span is NO_SPAN
            span.set_attribute("k", "v")
            NO_TRACING.ok(span)
    assert headers == {"content-type": "application/json"}  # no traceparent injected


def test_an_untraced_answer_is_the_handlers_own() -> None:
    seen: list[object] = []

    async def answer(request: object) -> object:
        seen.append(request)
        return "the response"

    request = object()
    assert asyncio.run(traced_answer(NO_TRACING, "admin x", request, answer)) == "the response"  # type: ignore[arg-type]
    assert seen == [request]
    asyncio.run(NO_TRACING.close())
