"""Will the feed's plan work with the gateway's topic settings? Checked before anything is published: once
at start when the shape of a micro-batch is known (the rate source), and for every micro-batch from its
per-topic facts (record count, seq span) otherwise.

What a micro-batch of one topic needs (docs/pipeline.md, "Sizing"):

* a **ring** topic (snapshot topics conflate out-of-order seqs, private topics need a user per record);
* ``reorder_window`` >= the reordering the publishing mode causes: none with ``--by-topic`` (one in-order
  producer per topic), chunk size x partitions with ``--lockstep`` (or the topic's seq span in the batch when
  smaller), the topic's seq span in the batch (last - first + 1) in free-running spread mode;
* ``capacity`` >= the topic's records in one micro-batch (its seq span when larger: given-up seqs take ring
  slots too): a micro-batch arrives faster than any subscriber reads, and a ring smaller than that makes
  every live subscriber lose all but the last ``capacity`` records of it (``lagged``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.gatewayapi import TopicState

__all__ = ["TopicFacts", "check_topic", "needed_window", "plan_problems"]


@dataclass(frozen=True, slots=True)
class TopicFacts:
    """One topic's records in one micro-batch."""

    topic: str
    records: int
    #: records with an explicit seq, and their smallest and largest seq
    sequenced: int = 0
    min_seq: int | None = None
    max_seq: int | None = None

    @property
    def span(self) -> int:
        if self.min_seq is None or self.max_seq is None:
            return 0
        return self.max_seq - self.min_seq + 1


def needed_window(facts: TopicFacts, *, by_topic: bool, lockstep: bool, chunk_size: int, partitions: int) -> int:
    if by_topic or partitions == 1 or facts.sequenced == 0:
        return 0
    if lockstep:
        return min(facts.span, chunk_size * partitions)
    return facts.span


def check_topic(
    state: TopicState, facts: TopicFacts, *, by_topic: bool, lockstep: bool, chunk_size: int, partitions: int
) -> str | None:
    """The reason this plan cannot work for this topic, in one line, or None."""
    where = f"topic {state.name!r}" if state.exists else f"topic {state.name!r} (rule {state.pattern!r})"
    if state.kind == "private":
        return f"{where} is a private topic: the feed publishes to shared topics only (no per-user `client`)"
    if state.kind == "snapshot":
        if not by_topic and partitions > 1 and facts.sequenced:
            return (
                f"{where} is a snapshot topic: out-of-order seqs are refused as stale, so spread mode cannot "
                f"feed it; use --by-topic"
            )
        return None
    window = needed_window(facts, by_topic=by_topic, lockstep=lockstep, chunk_size=chunk_size, partitions=partitions)
    if window > state.reorder_window:
        why = (
            f"--lockstep reorders by up to chunk size x partitions = {chunk_size} x {partitions}"
            if lockstep and window == chunk_size * partitions
            else f"spread mode puts its seqs up to {window} apart in one micro-batch ({facts.sequenced} records, seqs "
            f"{facts.min_seq}..{facts.max_seq})"
        )
        return (
            f"{where}: reorder_window {state.reorder_window} < {window}: {why}, so the gateway would give up "
            f"holes and lose records; raise reorder_window (config [[topics.rules]]), or use --by-topic, "
            f"--lockstep or smaller micro-batches"
        )
    slots = max(facts.records, facts.span)
    if slots > state.capacity:
        return (
            f"{where}: ring capacity {state.capacity} < {slots} records in one micro-batch: live subscribers "
            f"would lose all but the last {state.capacity} of every micro-batch (lagged); raise capacity "
            f"(config [[topics.rules]]) or make micro-batches smaller (--rows-per-batch, "
            f"--max-files-per-trigger)"
        )
    return None


def plan_problems(
    states: dict[str, TopicState], facts: list[TopicFacts], *, by_topic: bool, lockstep: bool, chunk_size: int, partitions: int
) -> list[str]:
    problems = []
    for f in facts:
        problem = check_topic(
            states[f.topic], f, by_topic=by_topic, lockstep=lockstep, chunk_size=chunk_size, partitions=partitions
        )
        if problem is not None:
            problems.append(problem)
    return problems
