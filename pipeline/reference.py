"""The fairness report of a delivery log, in pure Python (no Spark, no numpy).

Same definitions as the Spark job (:mod:`pipeline.figures`), exact percentiles only: the tests check the
Spark job (``--exact``) against it, and the load tester can use it on small logs without a JVM.

    >>> from pipeline.reference import report
    >>> report([{"topic": "t", "seq": 0, "client": "a", "publish_ns": 0, "deliver_ns": 5, "batch_id": 1}])["loss"]["rate"]
    0.0
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from pipeline import figures
from pipeline.figures import PairFacts

__all__ = ["facts", "report"]

_COLUMNS = tuple(figures.DELIVERY_LOG_COLUMNS)


def _as_tuple(row: Mapping | Sequence) -> tuple:
    if isinstance(row, Mapping):
        return tuple(row[c] for c in _COLUMNS)
    return tuple(row)


def _summary(values: list[int], percentiles: Sequence[float], count_key: str) -> dict:
    values = sorted(values)
    out: dict[str, int | float | None] = {count_key: len(values)}
    for p in percentiles:
        out[f"p{round(p * 100)}"] = figures.percentile(values, p)
    out["max"] = values[-1] if values else None
    return out


def facts(rows: Iterable[Mapping | Sequence]) -> dict:
    """The intermediate facts :func:`pipeline.figures.build_report` takes (and the row count)."""
    n = 0
    latency: dict[str, list[int]] = defaultdict(list)
    message_deliveries: dict[tuple[str, int], list[int]] = defaultdict(list)
    message_publish: dict[tuple[str, int], int] = {}
    pair_delivers: dict[tuple[str, str], list[int]] = defaultdict(list)
    pair_seqs: dict[tuple[str, str], list[int]] = defaultdict(list)
    for row in rows:
        topic, seq, client, publish_ns, deliver_ns, _batch = _as_tuple(row)
        n += 1
        latency[topic].append(deliver_ns - publish_ns)
        key = (topic, seq)
        message_deliveries[key].append(deliver_ns)
        message_publish[key] = min(publish_ns, message_publish.get(key, publish_ns))
        pair_delivers[(client, topic)].append(deliver_ns)
        pair_seqs[(client, topic)].append(seq)

    skews: list[int] = []
    skews_by_topic: dict[str, list[int]] = defaultdict(list)
    for (topic, _seq), delivers in message_deliveries.items():
        if len(delivers) >= 2:
            skew = max(delivers) - min(delivers)
            skews.append(skew)
            skews_by_topic[topic].append(skew)

    publishes: dict[str, list[int]] = defaultdict(list)
    for (topic, _seq), publish_ns in message_publish.items():
        publishes[topic].append(publish_ns)
    publish_gap = {topic: figures.largest_gap(sorted(times)) for topic, times in publishes.items()}

    pairs = []
    for (client, topic), delivers in pair_delivers.items():
        delivers.sort()
        seqs = pair_seqs[(client, topic)]
        pairs.append(
            PairFacts(
                client=client,
                topic=topic,
                deliveries=len(delivers),
                distinct_seqs=len(set(seqs)),
                first_seq=min(seqs),
                last_seq=max(seqs),
                first_deliver_ns=delivers[0],
                last_deliver_ns=delivers[-1],
                max_deliver_gap_ns=figures.largest_gap(delivers),
                max_publish_gap_ns=publish_gap[topic],
            )
        )
    return {
        "rows": n,
        "latency_by_topic": {t: _summary(v, figures.LATENCY_PERCENTILES, "count") for t, v in latency.items()},
        "skew": _summary(skews, figures.SKEW_PERCENTILES, "messages"),
        "skew_by_topic": {t: _summary(v, figures.SKEW_PERCENTILES, "messages") for t, v in skews_by_topic.items()},
        "pairs": pairs,
    }


def report(rows: Iterable[Mapping | Sequence]) -> dict:
    """The report of :mod:`pipeline.audit` (with ``--exact``) for ``rows``: mappings with the delivery log's
    column names, or tuples in the order of :data:`pipeline.figures.DELIVERY_LOG_COLUMNS`."""
    return figures.build_report(**facts(rows), exact=True)
