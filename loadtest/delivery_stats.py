"""The figures of a run, as pure functions of the delivery log (numpy arrays in, numbers out).

No I/O and no clock. Times are integer nanoseconds; the summary converts to milliseconds. Percentiles are
nearest-rank (numpy ``inverted_cdf``): the value below which at least p% of the samples lie, always one
of the samples, so known inputs give exact figures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class DeliveryLog:
    """One row per delivered ``msg`` entry; ``topic`` and ``client`` are codes into the name tuples.

    Rows of one client are in arrival order (the loss analysis relies on it).
    """

    topics: tuple[str, ...]
    clients: tuple[str, ...]
    topic: np.ndarray  # int32
    seq: np.ndarray  # int64
    client: np.ndarray  # int32
    publish_ns: np.ndarray  # int64, -1 when the message carried no timestamp
    deliver_ns: np.ndarray  # int64
    batch_id: np.ndarray  # int64, per client: the frame (WebSocket) or poll batch it came in

    def __len__(self) -> int:
        return len(self.seq)

    def select(self, mask: np.ndarray) -> DeliveryLog:
        """The rows where ``mask`` holds, same name tables."""
        return DeliveryLog(
            self.topics,
            self.clients,
            self.topic[mask],
            self.seq[mask],
            self.client[mask],
            self.publish_ns[mask],
            self.deliver_ns[mask],
            self.batch_id[mask],
        )


@dataclass(frozen=True, slots=True)
class Notices:
    """Loss notices received: each says the client will never see seqs ``[start, end)`` of the topic."""

    client: np.ndarray  # int32
    topic: np.ndarray  # int32
    start: np.ndarray  # int64
    end: np.ndarray  # int64, -1 for an open range (reason "epoch": the stream restarted)
    reason: tuple[str, ...] = ()

    @staticmethod
    def empty() -> Notices:
        z32, z64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        return Notices(z32, z32, z64, z64, ())


@dataclass(frozen=True, slots=True)
class LossFigures:
    delivered: int
    #: seqs covered by loss notices (``to - from`` summed)
    announced: int
    #: seqs missing inside a client's stream (before a later delivered seq) with no loss notice covering them
    silent: int
    #: how many separate silent holes
    silent_gaps: int
    #: deliveries of a seq at or below one already delivered to the same client on the same topic
    duplicates: int
    #: seqs after the last delivery that a client still reading at the end never got nor was told about
    undelivered: int
    #: loss notices with an open range (epoch restart)
    epoch_resets: int
    by_reason: dict[str, int] = field(default_factory=dict)


def percentiles(values: np.ndarray, ps: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """``n``, ``mean``, ``max`` and ``p<N>`` (nearest rank) of ``values``; zeros when empty."""
    values = np.asarray(values)
    out: dict[str, float] = {"n": int(values.size)}
    if values.size == 0:
        out.update({f"p{p}": 0.0 for p in ps}, mean=0.0, max=0.0)
        return out
    qs = np.percentile(values, ps, method="inverted_cdf")
    out.update({f"p{p}": float(q) for p, q in zip(ps, qs)})
    out["mean"] = float(values.mean())
    out["max"] = float(values.max())
    return out


def latencies(log: DeliveryLog) -> np.ndarray:
    """Publish-to-deliver time of every row that carried a publish timestamp (ns)."""
    ok = log.publish_ns >= 0
    return log.deliver_ns[ok] - log.publish_ns[ok]


def _group_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Indices where a new run of equal keys begins in a sorted array."""
    if sorted_keys.size == 0:
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])


def skews(log: DeliveryLog) -> np.ndarray:
    """Visibility skew per message: latest minus earliest delivery over the clients that got it (ns).

    A message is (topic, seq); only messages seen by at least two distinct clients count. A client that got
    a message twice counts once, at its first delivery.
    """
    if len(log) == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort((log.deliver_ns, log.client, log.seq, log.topic))
    topic, seq, client, t = log.topic[order], log.seq[order], log.client[order], log.deliver_ns[order]
    first = np.r_[True, (topic[1:] != topic[:-1]) | (seq[1:] != seq[:-1]) | (client[1:] != client[:-1])]
    topic, seq, t = topic[first], seq[first], t[first]
    starts = np.flatnonzero(np.r_[True, (topic[1:] != topic[:-1]) | (seq[1:] != seq[:-1])])
    counts = np.diff(np.r_[starts, topic.size])
    spread = np.maximum.reduceat(t, starts) - np.minimum.reduceat(t, starts)
    return spread[counts >= 2]


def time_to_last(log: DeliveryLog) -> np.ndarray:
    """Per message (topic, seq) that carried a publish timestamp: its latest delivery over the clients that
    got it minus its publish time (ns), i.e. how long one publish took to reach the last of its subscribers.
    A client that never got it does not count (that is loss, counted apart)."""
    ok = log.publish_ns >= 0
    if not ok.any():
        return np.zeros(0, np.int64)
    topic, seq, t, pub = log.topic[ok], log.seq[ok], log.deliver_ns[ok], log.publish_ns[ok]
    order = np.lexsort((seq, topic))
    topic, seq, t, pub = topic[order], seq[order], t[order], pub[order]
    starts = np.flatnonzero(np.r_[True, (topic[1:] != topic[:-1]) | (seq[1:] != seq[:-1])])
    return np.maximum.reduceat(t, starts) - pub[starts]


def window_peak(times_ns: np.ndarray, window_ns: int) -> int:
    """The most of ``times_ns`` (any order) inside any window of ``window_ns`` (a peak rate over that window)."""
    if times_ns.size == 0:
        return 0
    t = np.sort(times_ns)
    return int((np.searchsorted(t, t + window_ns, side="left") - np.arange(t.size)).max())


def jain(values: np.ndarray) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 1.0
    square_sum = float((x * x).sum())
    if square_sum == 0.0:
        return 1.0
    return float(x.sum()) ** 2 / (x.size * square_sum)


def batch_sizes(log: DeliveryLog) -> np.ndarray:
    """Message entries per delivered batch (a batch is a (client, batch_id) pair)."""
    if len(log) == 0:
        return np.zeros(0, np.int64)
    keys = log.client.astype(np.int64) * (int(log.batch_id.max()) + 1) + log.batch_id
    _, counts = np.unique(keys, return_counts=True)
    return counts


def per_client_counts(log: DeliveryLog, n_clients: int) -> np.ndarray:
    """Deliveries per client code (length ``n_clients``)."""
    return np.bincount(log.client, minlength=n_clients)[:n_clients]


def rate_series(deliver_ns: np.ndarray, t0_ns: int, bin_s: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(bin start in seconds after ``t0_ns``, deliveries per second in that bin)."""
    if deliver_ns.size == 0:
        return np.zeros(0), np.zeros(0)
    offsets = (deliver_ns - t0_ns) / 1e9
    offsets = offsets[offsets >= 0]
    n_bins = int(offsets.max() // bin_s) + 1 if offsets.size else 0
    counts = np.bincount((offsets // bin_s).astype(np.int64), minlength=n_bins)
    return np.arange(n_bins) * bin_s, counts / bin_s


def per_topic_latency(log: DeliveryLog) -> dict[str, dict[str, float]]:
    """Latency percentiles (ns) per topic name, for the topics that had deliveries."""
    ok = log.publish_ns >= 0
    topic, lat = log.topic[ok], (log.deliver_ns - log.publish_ns)[ok]
    order = np.argsort(topic, kind="stable")
    topic, lat = topic[order], lat[order]
    starts = _group_starts(topic)
    ends = np.r_[starts[1:], topic.size]
    return {log.topics[topic[a]]: percentiles(lat[a:b]) for a, b in zip(starts, ends)}


def _covered(a: int, b: int, ranges: list[tuple[int, int]]) -> int:
    """How many seqs of [a, b) the (start, end) ranges cover (ranges assumed disjoint)."""
    return sum(max(0, min(b, e) - max(a, s)) for s, e in ranges)


def loss_figures(
    log: DeliveryLog,
    notices: Notices,
    starts: dict[tuple[int, int], int] | None = None,
    expected_end: dict[int, int] | None = None,
    reading_at_end: set[int] | None = None,
) -> LossFigures:
    """Classify every missing seq of every (client, topic) stream as announced or silent.

    ``starts`` maps (client, topic) to the first seq the stream promised (the ``subscribed`` entry); without
    it a stream starts at its first delivery. A seq skipped before a later delivery is *announced* when a loss
    notice of that client and topic covers it, else *silent* (must be zero). ``expected_end`` maps a topic to
    one past the last seq published; the seqs after a stream's last delivery count as *undelivered* when the
    client is in ``reading_at_end`` (it was connected and reading when the run stopped) and no notice covers
    them.
    """
    starts = starts or {}
    ranges: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    announced = epoch_resets = 0
    by_reason: dict[str, int] = defaultdict(int)
    for i in range(notices.client.size):
        key = (int(notices.client[i]), int(notices.topic[i]))
        s, e = int(notices.start[i]), int(notices.end[i])
        reason = notices.reason[i] if i < len(notices.reason) else "?"
        if e < 0:
            epoch_resets += 1
            by_reason[reason] += 0
            continue
        ranges[key].append((s, e))
        announced += e - s
        by_reason[reason] += e - s

    silent = silent_gaps = duplicates = 0
    last_seen: dict[tuple[int, int], int] = {}
    if len(log):
        n_topics = max(len(log.topics), int(log.topic.max()) + 1)
        key = log.client.astype(np.int64) * n_topics + log.topic
        order = np.lexsort((np.arange(key.size), key))  # group by stream, keep arrival order
        key, seq = key[order], log.seq[order]
        gstart = _group_starts(key)
        gid = np.repeat(np.arange(gstart.size), np.diff(np.r_[gstart, key.size]))
        gmin = np.minimum.reduceat(seq, gstart)
        span = int((seq - gmin[gid]).max()) + 2
        shifted = seq - gmin[gid] + gid * span
        running = np.maximum.accumulate(shifted)
        prev_max = np.r_[-1, running[:-1]] - gid * span + gmin[gid]  # max seq before this row, same stream
        is_first = np.zeros(key.size, bool)
        is_first[gstart] = True
        # the expected next seq: after the running max, or the promised start for a stream's first row
        first_keys = key[gstart]
        promised = np.array([starts.get((int(k // n_topics), int(k % n_topics)), -1) for k in first_keys], dtype=np.int64)
        expected = prev_max + 1
        expected[gstart] = np.where(promised >= 0, promised, seq[gstart])
        duplicates = int(np.count_nonzero(~is_first & (seq <= prev_max)))
        holes = np.flatnonzero(seq > expected)
        for hole in holes:
            k = int(key[hole])
            stream = (k // n_topics, k % n_topics)
            a, b = int(expected[hole]), int(seq[hole])
            missing = b - a - _covered(a, b, ranges.get(stream, []))
            if missing > 0:
                silent += missing
                silent_gaps += 1
        last = running[np.r_[gstart[1:], key.size] - 1] - np.arange(gstart.size) * span + gmin
        last_seen = {(int(k // n_topics), int(k % n_topics)): int(m) for k, m in zip(first_keys, last)}

    undelivered = 0
    if expected_end is not None and reading_at_end:
        streams = set(starts) | set(last_seen)
        for stream in streams:
            client, topic = stream
            if client not in reading_at_end or topic not in expected_end:
                continue
            if stream in last_seen:
                a = last_seen[stream] + 1
            elif stream in starts:
                a = starts[stream]
            else:
                continue
            b = expected_end[topic]
            if b > a:
                undelivered += b - a - _covered(a, b, ranges.get(stream, []))

    return LossFigures(
        delivered=len(log),
        announced=announced,
        silent=silent,
        silent_gaps=silent_gaps,
        duplicates=duplicates,
        undelivered=undelivered,
        epoch_resets=epoch_resets,
        by_reason=dict(by_reason),
    )


def ms(stats: dict[str, float]) -> dict[str, float]:
    """A percentiles dict in ns converted to ms (``n`` kept), rounded to the microsecond."""
    return {k: (v if k == "n" else round(v / 1e6, 3)) for k, v in stats.items()}
