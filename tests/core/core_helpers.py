"""Small helpers for driving the engine in tests: decode batches, run cycles with writes completed."""

from __future__ import annotations

import orjson

from core import Engine, EngineConfig, TopicConfig, TopicKind, TopicRule


def make_engine(**topic_kwargs) -> Engine:
    rules = (
        TopicRule("snap.*", TopicConfig(kind=TopicKind.SNAPSHOT)),
        TopicRule("priv.*", TopicConfig(kind=TopicKind.PRIVATE, **topic_kwargs)),
        TopicRule("*", TopicConfig(**topic_kwargs)),
    )
    return Engine(EngineConfig(rules=rules), instance_id="t")


def decode(batch) -> list[dict]:
    return orjson.loads(batch.frame())


def cycle(engine: Engine, *, complete: bool = True) -> dict:
    """One run_cycle; returns {client_id: [decoded entries]} and reports the writes done."""
    got = {}
    for batch in engine.run_cycle():
        got[batch.client_id] = decode(batch)
        if complete:
            engine.write_done(batch.client_id)
    return got


def messages(entries: list[dict], topic: str | None = None) -> list[int]:
    return [e["seq"] for e in entries if e["type"] == "msg" and (topic is None or e["topic"] == topic)]
