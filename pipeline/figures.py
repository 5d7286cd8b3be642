"""The figures of the fairness report, defined once, in plain Python.

Both the Spark job (:mod:`pipeline.audit`) and the pure-Python reference (:mod:`pipeline.reference`) reduce a
delivery log to the same small intermediate facts (per-topic percentiles, per (client, topic) pair facts) and
hand them to :func:`build_report`, which derives loss, starvation and fairness the same way for both. The
large-data steps (percentiles, consecutive gaps) are also defined here as functions over plain lists, which is
what the reference uses and what the Spark expressions must agree with.

Definitions (all times in ns, from the log's ``publish_ns`` / ``deliver_ns``):

* latency of a delivery: ``deliver_ns - publish_ns``; per topic: count, p50, p90, p99, max.
* skew of a message (topic, seq) delivered at least twice: ``max(deliver_ns) - min(deliver_ns)`` over its
  deliveries (normally one per client); overall and per topic: count, p50, p99, max.
* publish gap of a topic: the largest difference between consecutive values of the sorted publish times of
  its messages (a message's publish time: the smallest ``publish_ns`` logged for it; only messages delivered
  to someone appear in a delivery log). Delivery gap of a (client, topic) pair: the same over the sorted
  ``deliver_ns`` of the pair. Fewer than two values: gap 0. Starvation of a pair: ``excess_ns`` = delivery gap
  - publish gap (how much longer the client went without news of the topic than the topic itself was quiet).
* loss of a pair: ``expected = last_seq - first_seq + 1`` over the seqs the client saw, ``missing =
  expected - distinct seqs seen``; loss rate = sum missing / sum expected over all pairs.
* delivery rate of a client: its deliveries / (its last ``deliver_ns`` - its first ``deliver_ns``) in
  deliveries per second; clients with fewer than two deliveries or a zero span have no rate and are left out.
  Jain's fairness index of the rates: ``(sum x)^2 / (n * sum x^2)``, 1 when all equal, 1/n when one client
  gets everything.
* percentiles: exact ones interpolate linearly between the two closest ranks (position ``p * (n - 1)`` in
  the sorted values), which is Spark's ``percentile``; approximate ones are Spark's ``percentile_approx``
  with accuracy :data:`DEFAULT_ACCURACY` (an actual value whose rank is within ``n / accuracy`` of the exact
  rank).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "ClientFacts",
    "DEFAULT_ACCURACY",
    "DELIVERY_LOG_COLUMNS",
    "LATENCY_PERCENTILES",
    "SKEW_PERCENTILES",
    "WORST",
    "PairFacts",
    "build_report",
    "jain_of_sums",
    "report_from_parts",
    "clients_of",
    "jain",
    "largest_gap",
    "percentile",
    "percentile_method",
]

#: The delivery log the load tester writes, column -> Arrow/Spark type name.
DELIVERY_LOG_COLUMNS = {
    "topic": "string",
    "seq": "int64",
    "client": "string",
    "publish_ns": "int64",
    "deliver_ns": "int64",
    "batch_id": "int64",
}

LATENCY_PERCENTILES = (0.5, 0.9, 0.99)
SKEW_PERCENTILES = (0.5, 0.99)

#: ``percentile_approx`` accuracy: a rank error of at most n/10,000 (0.01 % of the values), i.e. the p99 of a
#: million latencies is a value ranked between 989,900th and 990,100th. Spark's own default, stated
#: explicitly so that the report can say what it used; memory per group grows with it (~accuracy values).
DEFAULT_ACCURACY = 10_000

#: How many (client, topic) pairs the report lists as the worst for starvation and for loss.
WORST = 10


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Exact percentile with linear interpolation (Spark's ``percentile``); ``None`` for no values."""
    if not sorted_values:
        return None
    position = p * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = math.ceil(position)
    low_value = sorted_values[lower]
    if lower == upper:
        return float(low_value)
    return (upper - position) * low_value + (position - lower) * sorted_values[upper]


def largest_gap(sorted_values: Sequence[int]) -> int:
    """Largest difference between consecutive sorted values; 0 for fewer than two."""
    return max((b - a for a, b in zip(sorted_values, sorted_values[1:])), default=0)


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` of non-negative values; ``None`` for no values or
    all zeros."""
    xs = list(values)
    top = max(xs, default=0)
    if top <= 0:
        return None
    xs = [x / top for x in xs]  # scale-free; keeps squares of tiny or huge rates in range
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def percentile_method(exact: bool, accuracy: int = DEFAULT_ACCURACY) -> dict:
    """The report's statement of how its percentiles were computed."""
    if exact:
        return {"method": "exact", "function": "percentile", "interpolation": "linear", "accuracy": None}
    return {
        "method": "approximate",
        "function": "percentile_approx",
        "accuracy": accuracy,
        "max_rank_error": f"n/{accuracy}",
    }


@dataclass(frozen=True, slots=True)
class PairFacts:
    """What a delivery log says about one (client, topic) pair."""

    client: str
    topic: str
    deliveries: int
    distinct_seqs: int
    first_seq: int
    last_seq: int
    first_deliver_ns: int
    last_deliver_ns: int
    max_deliver_gap_ns: int
    #: The topic's publish gap (same for every pair of the topic).
    max_publish_gap_ns: int

    @property
    def expected(self) -> int:
        return self.last_seq - self.first_seq + 1

    @property
    def missing(self) -> int:
        return self.expected - self.distinct_seqs

    @property
    def excess_ns(self) -> int:
        return self.max_deliver_gap_ns - self.max_publish_gap_ns

    def table_row(self) -> dict:
        """The pair's row in the ``pairs`` output table."""
        return {
            **asdict(self),
            "expected": self.expected,
            "missing": self.missing,
            "loss_rate": self.missing / self.expected,
            "excess_ns": self.excess_ns,
        }


@dataclass(frozen=True, slots=True)
class ClientFacts:
    client: str
    deliveries: int
    first_deliver_ns: int
    last_deliver_ns: int

    @property
    def span_ns(self) -> int:
        return self.last_deliver_ns - self.first_deliver_ns

    @property
    def rate_per_s(self) -> float | None:
        if self.deliveries < 2 or self.span_ns <= 0:
            return None
        return self.deliveries / (self.span_ns / 1e9)

    def table_row(self) -> dict:
        return {**asdict(self), "span_ns": self.span_ns, "rate_per_s": self.rate_per_s}


def clients_of(pairs: Iterable[PairFacts]) -> list[ClientFacts]:
    """Per-client facts, folded from its pairs; sorted by client."""
    acc: dict[str, list[int]] = {}
    for p in pairs:
        c = acc.get(p.client)
        if c is None:
            acc[p.client] = [p.deliveries, p.first_deliver_ns, p.last_deliver_ns]
        else:
            c[0] += p.deliveries
            c[1] = min(c[1], p.first_deliver_ns)
            c[2] = max(c[2], p.last_deliver_ns)
    return [ClientFacts(name, *acc[name]) for name in sorted(acc)]


def _pair_key(p: PairFacts) -> tuple[str, str]:
    return (p.client, p.topic)


def build_report(
    *,
    rows: int,
    latency_by_topic: dict[str, dict],
    skew: dict,
    skew_by_topic: dict[str, dict],
    pairs: Iterable[PairFacts],
    exact: bool,
    accuracy: int = DEFAULT_ACCURACY,
) -> dict:
    """The report (JSON-ready) from the per-topic percentile summaries and the pair facts.

    ``latency_by_topic[t]`` = ``{"count", "p50", "p90", "p99", "max"}``; ``skew`` and ``skew_by_topic[t]`` =
    ``{"messages", "p50", "p99", "max"}``.
    """
    pairs = sorted(pairs, key=_pair_key)
    clients = clients_of(pairs)
    rates = [c.rate_per_s for c in clients if c.rate_per_s is not None]
    by_excess = sorted(pairs, key=lambda p: (-p.excess_ns, p.client, p.topic))
    by_loss = sorted((p for p in pairs if p.missing), key=lambda p: (-p.missing / p.expected, p.client, p.topic))
    return report_from_parts(
        rows=rows, latency_by_topic=latency_by_topic, skew=skew, skew_by_topic=skew_by_topic, pairs=len(pairs),
        expected=sum(p.expected for p in pairs), missing=sum(p.missing for p in pairs), pairs_with_loss=len(by_loss),
        worst_excess=by_excess[:WORST], worst_loss=by_loss[:WORST], clients=len(clients),
        rates={"n": len(rates), "jain": jain(rates), "min": min(rates, default=None), "max": max(rates, default=None)},
        exact=exact, accuracy=accuracy,
    )  # fmt: skip


def jain_of_sums(n: int, total: float | None, squares: float | None) -> float | None:
    """Jain's index from the count, sum and sum of squares of the values (what a distributed job gathers)."""
    if not n or not total or not squares:
        return None
    return total * total / (n * squares)


def report_from_parts(
    *,
    rows: int,
    latency_by_topic: dict[str, dict],
    skew: dict,
    skew_by_topic: dict[str, dict],
    pairs: int,
    expected: int,
    missing: int,
    pairs_with_loss: int,
    worst_excess: Sequence[PairFacts],
    worst_loss: Sequence[PairFacts],
    clients: int,
    rates: dict,
    exact: bool,
    accuracy: int = DEFAULT_ACCURACY,
) -> dict:
    """The report from totals and the worst pairs (:func:`build_report` computes them from every pair; the
    Spark job computes them in Spark and collects only these). ``worst_excess`` sorted by excess descending,
    ``worst_loss`` (pairs with loss) by loss rate descending, ties by client then topic; ``rates``:
    ``{"n", "jain", "min", "max"}`` of the clients' delivery rates."""
    return {
        "rows": rows,
        "topics": len(latency_by_topic),
        "clients": clients,
        "percentiles": percentile_method(exact, accuracy),
        "latency_ns": {topic: latency_by_topic[topic] for topic in sorted(latency_by_topic)},
        "skew_ns": {**skew, "by_topic": {topic: skew_by_topic[topic] for topic in sorted(skew_by_topic)}},
        "starvation": {
            "pairs": pairs,
            "max_excess_ns": worst_excess[0].excess_ns if worst_excess else None,
            "worst": [
                {
                    "client": p.client,
                    "topic": p.topic,
                    "max_deliver_gap_ns": p.max_deliver_gap_ns,
                    "max_publish_gap_ns": p.max_publish_gap_ns,
                    "excess_ns": p.excess_ns,
                }
                for p in worst_excess[:WORST]
            ],
        },
        "loss": {
            "expected": expected,
            "missing": missing,
            "rate": missing / expected if expected else None,
            "pairs_with_loss": pairs_with_loss,
            "worst": [
                {
                    "client": p.client,
                    "topic": p.topic,
                    "expected": p.expected,
                    "missing": p.missing,
                    "rate": p.missing / p.expected,
                }
                for p in worst_loss[:WORST]
            ],
        },
        "fairness": {
            "jain": rates["jain"],
            "clients_with_rate": rates["n"],
            "min_rate_per_s": rates["min"],
            "max_rate_per_s": rates["max"],
        },
    }
