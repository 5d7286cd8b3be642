"""The invariant of a chaos run (docs/reliability.md), as pure functions over what the clients recorded.

A client's record of one topic is a list of *events*, in the order the client received them, each a dict:

- ``{"ev": "sub", "epoch": E, "seq": S, "kind": K}``: a ``subscribed`` entry (a first subscribe, a resubscribe
  with ``since`` after a reconnect, or the gateway's unasked one after an epoch change);
- ``{"ev": "msg", "seq": S, "data": D}``: a ``msg`` entry (``D`` carries the publisher's ``p`` and ``n``);
- ``{"ev": "loss", "from": A, "to": B, "reason": R}``: a ``loss`` entry (``B`` None for ``epoch``);
- ``{"ev": "closed", "reason": R}``: a ``closed`` entry (``taken_over``, ``lost``, ``deleted``).

Optional keys (``t``: when it was received, Unix seconds) are ignored here.

What is checked:

1. **Ring topics, per client and topic:** the seqs of the ``msg`` entries and the ``loss`` ranges tile the
   seq line from where the first subscription started: no gap (a seq skipped with no notice), no duplicate
   (a seq twice, or a loss over a seq already had), and an epoch change only with an ``epoch`` loss next to
   its ``subscribed``. Snapshot topics: seqs only go up (a jump is conflation), never twice.
2. **Private queues, per client:** within one subscription the seqs are contiguous and in order; a seq
   below the next one needed right after a (re)subscribe is a redelivery (at-least-once across a takeover,
   docs/protocol.md), counted, not a violation; elsewhere it is a duplicate. **Per user:** every message a
   publisher was told was accepted reached one of the user's connections, in publisher order; unless the
   queue was announced lost (``closed`` ``lost``) after it was accepted, or it was accepted within
   ``wipe_window_s`` before Redis lost its data (the documented unannounced loss of docs/cluster.md §8,
   listed apart as *expected*).
3. **Same seq, same message:** every client that got seq S of a topic in epoch E got the same data.
4. **Accepted means retained:** for each ring topic, what it holds at the end (read once more after the
   run): for each publisher, every message accepted after the oldest of its messages the ring still holds
   is in the ring, once, in publisher order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken promise: ``kind`` (gap, duplicate, overlap, silent_epoch, backwards, private_missing,
    private_order, mismatch, ring_missing, ring_order), where, and the seq range ``[from_seq, to_seq)``
    (payload numbers ``n`` for the per-publisher checks)."""

    kind: str
    client: str
    topic: str
    from_seq: int | None
    to_seq: int | None
    detail: str = ""

    def __str__(self) -> str:
        return (f"{self.kind}: client {self.client} topic {self.topic} [{self.from_seq}, {self.to_seq}) {self.detail}").rstrip()


@dataclass
class StreamStats:
    messages: int = 0
    redelivered: int = 0
    repeats: int = 0
    losses: dict[str, int] = field(default_factory=dict)
    lost_seqs: int = 0
    closed: dict[str, int] = field(default_factory=dict)


def check_stream(client: str, topic: str, kind: str, events: Sequence[Mapping[str, Any]]) -> tuple[list[Violation], StreamStats]:
    """Check 1 and 2 (per client) for one client's record of one topic."""
    out: list[Violation] = []
    stats = StreamStats()
    epoch: str | None = None
    nxt: int | None = None
    epoch_loss_seen = False  # an `epoch` loss since the last `subscribed` (it may precede the new one)
    need_epoch_loss = False  # a `subscribed` changed the epoch: an `epoch` loss must come before any msg
    just_subscribed = False  # no msg since the last `subscribed` (redeliveries allowed then)
    top = -1  # private: the highest seq had in this epoch (redeliveries stay below it)

    def violation(kind_: str, a: int | None, b: int | None, detail: str = "") -> None:
        out.append(Violation(kind_, client, topic, a, b, detail))

    for e in events:
        ev = e["ev"]
        if ev == "sub":
            new_epoch, seq = str(e["epoch"]), int(e["seq"])
            if kind == "private":
                # the queue's first seq still queued: a takeover may start below (redeliveries) or above
                # (another connection committed what came meanwhile; the per-user check sees it delivered)
                if new_epoch != epoch:
                    top = -1
                epoch, nxt = new_epoch, seq
            elif epoch is None:
                epoch, nxt = new_epoch, seq
            elif new_epoch != epoch:
                if not epoch_loss_seen:
                    need_epoch_loss = True
                epoch, nxt = new_epoch, seq
            epoch_loss_seen = False
            just_subscribed = True
        elif ev == "loss":
            a, b, reason = e["from"], e["to"], str(e["reason"])
            stats.losses[reason] = stats.losses.get(reason, 0) + 1
            if b is None:
                if need_epoch_loss:
                    need_epoch_loss = False
                else:
                    epoch_loss_seen = True
                continue
            a, b = int(a), int(b)
            if reason == "gap":  # fanout_client's own notice of a hole the gateway did not announce
                violation("gap", a, b, "seen by the client library (no loss notice from the gateway)")
            stats.lost_seqs += max(0, b - a)
            if nxt is None:
                nxt = b
                continue
            if a > nxt:
                violation("gap", nxt, a, f"before loss [{a}, {b}) {reason}")
            elif a < nxt:
                violation("overlap", a, min(b, nxt), f"loss [{a}, {b}) {reason} over seqs already had")
            nxt = max(nxt, b)
        elif ev == "msg":
            seq = int(e["seq"])
            if need_epoch_loss:
                violation("silent_epoch", nxt, None, f"epoch changed to {epoch} with no epoch loss")
                need_epoch_loss = False
            if nxt is None:
                nxt = seq
            if kind == "private":
                # a (re)subscribe restarts at the queue's first seq still queued: within one subscription
                # the seqs are contiguous; below the highest already had is a redelivery after a takeover
                if seq < nxt:
                    violation("duplicate", seq, seq + 1, "private queue, within one subscription")
                    continue
                if seq > nxt:
                    violation("gap", nxt, seq, "private queue")
                nxt = seq + 1
                if seq <= top:
                    stats.redelivered += 1
                else:
                    stats.messages += 1
                    top = seq
                just_subscribed = False
                continue
            if seq == nxt:
                nxt += 1
            elif seq > nxt:
                if kind != "snapshot":
                    violation("gap", nxt, seq)
                nxt = seq + 1
            elif kind == "snapshot" and just_subscribed and seq == nxt - 1:
                stats.repeats += 1  # the latest value again on a resubscribe
                just_subscribed = False
                continue
            else:
                violation("duplicate" if kind != "snapshot" else "backwards", seq, seq + 1)
                continue
            stats.messages += 1
            just_subscribed = False
        elif ev == "closed":
            reason = str(e["reason"])
            stats.closed[reason] = stats.closed.get(reason, 0) + 1
    if need_epoch_loss:
        violation("silent_epoch", nxt, None, f"epoch changed to {epoch} with no epoch loss (at the end)")
    return out, stats


def check_consistency(
    records: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], kinds: Mapping[str, str]
) -> list[Violation]:
    """Check 3: the same (topic, epoch, seq) carries the same data for every client (shared topics only)."""
    seen: dict[tuple[str, str, int], tuple[str, Any]] = {}
    out: list[Violation] = []
    for client, topics in records.items():
        for topic, events in topics.items():
            if kinds.get(topic) == "private":
                continue
            epoch = None
            for e in events:
                if e["ev"] == "sub":
                    epoch = str(e["epoch"])
                elif e["ev"] == "msg" and epoch is not None:
                    key = (topic, epoch, int(e["seq"]))
                    first = seen.setdefault(key, (client, e["data"]))
                    if first[1] != e["data"]:
                        out.append(
                            Violation(
                                "mismatch",
                                client,
                                topic,
                                key[2],
                                key[2] + 1,
                                f"epoch {epoch}: {e['data']!r} here, {first[1]!r} at {first[0]}",
                            )
                        )
    return out


def _payload(data: Any) -> tuple[str, int] | None:
    if isinstance(data, dict) and isinstance(data.get("p"), str) and isinstance(data.get("n"), int):
        return data["p"], data["n"]
    return None


def check_private(
    user: str,
    topic: str,
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    accepted: Iterable[tuple[str, int, float]],
    wipes: Sequence[float] = (),
    wipe_window_s: float = 1.0,
) -> tuple[list[Violation], list[Violation]]:
    """Check 2 (per user): ``streams`` are the user's clients' records of ``topic``; ``accepted`` the
    (publisher, n, accepted at) of every publish to this user's queue a publisher was told was accepted.
    Returns (violations, expected losses)."""
    delivered: dict[tuple[str, int], int] = {}
    lost_at: list[float] = []
    out: list[Violation] = []
    order: dict[str, int] = {}
    for client, events in streams.items():
        for e in events:
            if e["ev"] == "closed" and e["reason"] == "lost":
                lost_at.append(float(e.get("t", float("inf"))))
            if e["ev"] != "msg":
                continue
            key = _payload(e["data"])
            if key is None:
                continue
            delivered[key] = delivered.get(key, 0) + 1
            if key[1] < order.get(f"{client}/{key[0]}", -1):
                out.append(
                    Violation(
                        "private_order",
                        client,
                        topic,
                        key[1],
                        key[1] + 1,
                        f"user {user}: publisher {key[0]} n={key[1]} after a later one",
                    )
                )
            order[f"{client}/{key[0]}"] = max(order.get(f"{client}/{key[0]}", -1), key[1])
    expected: list[Violation] = []
    missing: dict[str, list[int]] = defaultdict(list)
    for pub, n, at in accepted:
        if (pub, n) in delivered:
            continue
        if any(t >= at for t in lost_at):
            continue  # announced: the queue was closed `lost` after it was accepted
        if any(0 <= w - at <= wipe_window_s for w in wipes):
            expected.append(
                Violation(
                    "private_lost_in_wipe",
                    user,
                    topic,
                    n,
                    n + 1,
                    f"publisher {pub}: accepted {min(w - at for w in wipes if w >= at):.3f} s "
                    "before Redis lost its data (docs/cluster.md §8)",
                )
            )
            continue
        missing[pub].append(n)
    for pub, ns in missing.items():
        for a, b in _runs(sorted(ns)):
            out.append(
                Violation(
                    "private_missing",
                    user,
                    topic,
                    a,
                    b,
                    f"publisher {pub}: accepted, never delivered to any connection of the user",
                )
            )
    return out, expected


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """[1, 2, 3, 7] -> [(1, 4), (7, 8)]."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs


def check_ring_holds(
    topic: str,
    ring: Sequence[Mapping[str, Any]],
    accepted: Mapping[str, Iterable[int]],
    unknown: Mapping[str, Iterable[int]] | None = None,
) -> list[Violation]:
    """Check 4: ``ring`` is the topic's retained messages at the end (``msg`` events of one epoch, in seq
    order); ``accepted`` maps each publisher to the payload numbers it was told were accepted on this topic;
    ``unknown`` to those whose outcome it never learned (it gave up waiting, or was refused after the record
    may have landed). Those are in no order check: a node may still publish one after its publisher moved on
    to another node and published newer records there."""
    held: dict[str, list[int]] = defaultdict(list)
    unsure = {pub: set(ns) for pub, ns in (unknown or {}).items()}
    for e in ring:
        key = _payload(e.get("data"))
        if key is not None and key[1] not in unsure.get(key[0], ()):
            held[key[0]].append(key[1])
    out: list[Violation] = []
    for pub, ns in held.items():
        for x, y in zip(ns, ns[1:], strict=False):
            if y <= x:
                out.append(Violation("ring_order", "ring", topic, y, y + 1, f"publisher {pub}: n={y} after n={x}"))
        present = set(ns)
        oldest = min(ns)
        missing = sorted(n for n in set(accepted.get(pub, ())) if n > oldest and n not in present)
        for a, b in _runs(missing):
            out.append(
                Violation(
                    "ring_missing",
                    "ring",
                    topic,
                    a,
                    b,
                    f"publisher {pub}: accepted, newer than n={oldest} the ring holds, not in it",
                )
            )
    return out


@dataclass
class CheckResult:
    violations: list[Violation]
    expected: list[Violation]
    streams: dict[str, dict[str, StreamStats]]

    def as_json(self) -> dict[str, Any]:
        return {
            "violations": [asdict(v) for v in self.violations],
            "expected_losses": [asdict(v) for v in self.expected],
            "streams": {c: {t: asdict(s) for t, s in ts.items()} for c, ts in self.streams.items()},
        }


def check_all(
    records: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    kinds: Mapping[str, str],
    users: Mapping[str, str],
    private_accepted: Mapping[tuple[str, str], Iterable[tuple[str, int, float]]],
    rings: Mapping[str, Sequence[Mapping[str, Any]]],
    ring_accepted: Mapping[str, Mapping[str, Iterable[int]]],
    wipes: Sequence[float] = (),
    ring_unknown: Mapping[str, Mapping[str, Iterable[int]]] | None = None,
) -> CheckResult:
    """Every check over a whole run. ``records``: client -> topic -> events; ``kinds``: topic -> kind;
    ``users``: client -> user (clients holding private queues); ``private_accepted``: (user, topic) ->
    accepted publishes; ``rings``: topic -> its messages at the end; ``ring_accepted``: topic -> publisher
    -> accepted payload numbers; ``wipes``: when Redis lost its data."""
    violations: list[Violation] = []
    expected: list[Violation] = []
    streams: dict[str, dict[str, StreamStats]] = {}
    for client, topics in records.items():
        for topic, events in topics.items():
            found, stats = check_stream(client, topic, kinds.get(topic, "ring"), events)
            violations += found
            streams.setdefault(client, {})[topic] = stats
    violations += check_consistency(records, kinds)
    by_user: dict[tuple[str, str], dict[str, Sequence[Mapping[str, Any]]]] = defaultdict(dict)
    for client, user in users.items():
        for topic, events in records.get(client, {}).items():
            if kinds.get(topic) == "private":
                by_user[(user, topic)][client] = events
    for key in set(by_user) | set(private_accepted):
        found, exp = check_private(key[0], key[1], by_user.get(key, {}), private_accepted.get(key, ()), wipes)
        violations += found
        expected += exp
    for topic, ring in rings.items():
        violations += check_ring_holds(topic, ring, ring_accepted.get(topic, {}), (ring_unknown or {}).get(topic))
    return CheckResult(violations, expected, streams)
