"""From what the processes of a run reported to the figures of ``summary.json``.

:func:`merge` joins the worker dumps into one delivery log; :func:`summarize` computes every figure with
:mod:`loadtest.delivery_stats`. Latency, skew and fairness are taken over the *light* clients (not stalled, not the
dominator): the figures a well-behaved client sees. Loss is counted for everyone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest import delivery_stats
from loadtest.delivery_stats import DeliveryLog, Notices
from loadtest.scenarios import Plan, Scenario


@dataclass(frozen=True, slots=True)
class RunData:
    """Everything a run collected, before any figure is computed."""

    log: DeliveryLog
    notices: Notices
    #: (client, topic) -> first promised seq
    starts: dict[tuple[int, int], int]
    #: by client code: the worker's state dict (ready, connected_ns, closed_ns, closed_reason, error)
    clients: dict[int, dict[str, Any]]
    published: dict[str, Any]
    workers: list[dict[str, Any]]


def merge(dumps: list[dict[str, Any]], plan: Plan, published: dict[str, Any]) -> RunData:
    """Concatenate the worker dumps (rows of a client stay in arrival order)."""
    types = {"topic": np.int32, "client": np.int32, "seq": np.int64, "publish_ns": np.int64,
             "deliver_ns": np.int64, "batch_id": np.int64}
    columns = {name: np.concatenate([np.frombuffer(d["arrays"][name], dtype) for d in dumps])
               if dumps else np.zeros(0, dtype) for name, dtype in types.items()}
    log = DeliveryLog(plan.topics, tuple(c.name for c in plan.clients), columns["topic"], columns["seq"],
                      columns["client"], columns["publish_ns"], columns["deliver_ns"], columns["batch_id"])
    losses = [row for d in dumps for row in d["losses"] if row[1] >= 0]
    notices = Notices(np.array([r[0] for r in losses], np.int32), np.array([r[1] for r in losses], np.int32),
                      np.array([r[2] for r in losses], np.int64), np.array([r[3] for r in losses], np.int64),
                      tuple(r[4] for r in losses))
    starts: dict[tuple[int, int], int] = {}
    clients: dict[int, dict[str, Any]] = {}
    for d in dumps:
        starts.update(d["starts"])
        clients.update(d["clients"])
    return RunData(log, notices, starts, clients, published, dumps)


def _role_codes(plan: Plan, role: str) -> np.ndarray:
    return np.array([i for i, c in enumerate(plan.clients) if c.role == role], np.int64)


def summarize(data: RunData, scenario: Scenario, plan: Plan, target: str, go_ns: int,
              stall_resumes: bool) -> dict[str, Any]:
    """The figures of one run (JSON-ready). CPU figures are added by the runner."""
    log = data.log
    light = _role_codes(plan, "light")
    light_log = log.select(np.isin(log.client, light))
    lat = delivery_stats.latencies(light_log)

    ready = {c for c, st in data.clients.items() if st.get("ready")}
    closed = {c for c, st in data.clients.items() if st.get("closed_ns")}
    reading = {c for c in ready - closed if plan.clients[c].role != "stalled" or stall_resumes}
    accepted = data.published.get("accepted", {})
    index = plan.topic_index()
    expected_end = _expected_end(data.starts, {index[t]: n for t, n in accepted.items() if t in index}, target)
    loss = delivery_stats.loss_figures(log, data.notices, data.starts, expected_end, reading)
    loss_by_role = {}
    for role in ("light", "stalled", "dominator"):
        codes = _role_codes(plan, role)
        if codes.size == 0:
            continue
        mask_n = np.isin(data.notices.client, codes)
        role_notices = Notices(data.notices.client[mask_n], data.notices.topic[mask_n],
                               data.notices.start[mask_n], data.notices.end[mask_n],
                               tuple(r for r, m in zip(data.notices.reason, mask_n) if m))
        role_starts = {k: v for k, v in data.starts.items() if plan.clients[k[0]].role == role}
        figures = delivery_stats.loss_figures(log.select(np.isin(log.client, codes)), role_notices, role_starts,
                                       expected_end, reading)
        loss_by_role[role] = dataclasses.asdict(figures)

    # fairness over the light clients that were ready: raw delivery counts, and the share of what was
    # published on their own topics (1.0 each when nobody misses anything)
    light_ready = np.array([c for c in light if c in ready], np.int64)
    counts = delivery_stats.per_client_counts(light_log, len(plan.clients))[light_ready] if light_ready.size else \
        np.zeros(0)
    topic_accepted = np.array([accepted.get(t, 0) for t in plan.topics], np.float64)
    owed = np.array([topic_accepted[list(plan.clients[c].topics)].sum() for c in light_ready], np.float64)
    shares = np.divide(counts, owed, out=np.zeros(counts.size), where=owed > 0)

    window_ns = 0
    if len(log):
        first_pub = data.published.get("first_ns", go_ns)
        window_ns = int(log.deliver_ns.max()) - int(first_pub)
    _, series = delivery_stats.rate_series(log.deliver_ns, go_ns, 0.1)
    sizes = delivery_stats.batch_sizes(log)
    skew = delivery_stats.skews(light_log)
    classes = _class_latency(light_log, plan)

    by_transport = {}
    transports = sorted({plan.clients[c].transport for c in light})
    if len(transports) > 1:
        for transport in transports:
            codes = np.array([c for c in light if plan.clients[c].transport == transport], np.int64)
            by_transport[transport] = delivery_stats.ms(delivery_stats.percentiles(
                delivery_stats.latencies(light_log.select(np.isin(light_log.client, codes)))))

    stalled_codes = _role_codes(plan, "stalled")
    publish_s = max(1e-9, (data.published.get("last_ns", go_ns) - data.published.get("first_ns", go_ns)) / 1e9)
    summary: dict[str, Any] = {
        "scenario": dataclasses.asdict(scenario),
        "target": target,
        "clients": {
            "planned": len(plan.clients), "ready": len(ready), "failed": len(plan.clients) - len(ready),
            "closed_during_run": len(closed),
            "closed_by_role": {r: sum(1 for c in closed if plan.clients[c].role == r)
                               for r in ("light", "stalled", "dominator")},
            "first_errors": sorted({st["error"] for st in data.clients.values() if st.get("error")})[:5],
            "close_reasons": sorted({st["closed_reason"] for st in data.clients.values()
                                     if st.get("closed_reason")})[:5],
        },
        "published": {
            "sent": data.published.get("sent", 0),
            "accepted": int(sum(accepted.values())),
            "accepted_per_topic": dict(accepted),
            "per_s": round(data.published.get("sent", 0) / publish_s, 1),
            "errors": data.published.get("errors", {}),
            "error_samples": data.published.get("error_samples", []),
        },
        "deliveries": {
            "total": len(log), "light": len(light_log),
            "per_s": round(len(log) / (window_ns / 1e9), 1) if window_ns > 0 else 0.0,
            "peak_per_s": float(series.max()) if series.size else 0.0,
            "frames": int(sum(w["frames"] for w in data.workers)),
            "dropped_rows": int(sum(w["dropped_rows"] for w in data.workers)),
            "foreign": int(sum(w["foreign"] for w in data.workers)),
            "window_s": round(window_ns / 1e9, 3),
        },
        "latency_ms": delivery_stats.ms(delivery_stats.percentiles(lat)),
        "latency_ms_by_transport": by_transport,
        "latency_ms_stalled": delivery_stats.ms(delivery_stats.percentiles(
            delivery_stats.latencies(log.select(np.isin(log.client, stalled_codes)))))
        if stalled_codes.size else {},
        "skew_ms": delivery_stats.ms(delivery_stats.percentiles(skew)),
        "loss": dataclasses.asdict(loss),
        "loss_by_role": loss_by_role,
        "fairness": {"jain_rate": round(delivery_stats.jain(counts), 4),
                     "jain_share": round(delivery_stats.jain(shares), 4),
                     "clients": int(light_ready.size),
                     "share_min": round(float(shares.min()), 4) if shares.size else 0.0},
        "batch_entries": {k: (v if k == "n" else round(v, 2))
                          for k, v in delivery_stats.percentiles(sizes).items()},
        "topic_classes_ms": classes,
        "client_errors": _sum_counters(w["errors"] for w in data.workers),
        "client_error_samples": [s for w in data.workers for s in w["error_samples"]][:10],
    }
    if "dominator" in {c.role for c in plan.clients}:
        dom = _role_codes(plan, "dominator")
        summary["latency_ms_dominator"] = delivery_stats.ms(delivery_stats.percentiles(
            delivery_stats.latencies(log.select(np.isin(log.client, dom)))))
    return summary


def _expected_end(starts: dict[tuple[int, int], int], accepted: dict[int, int], target: str) -> dict[int, int]:
    """One past the last seq of each topic: its first promised seq plus what was accepted (nchan: from 0)."""
    first: dict[int, int] = {}
    for (_client, topic), seq in starts.items():
        first[topic] = min(first.get(topic, seq), seq)
    if target == "nchan":
        return dict(accepted)
    return {t: first[t] + n for t, n in accepted.items() if t in first}


def _class_latency(light_log: DeliveryLog, plan: Plan) -> dict[str, dict[str, float]]:
    """Latency per topic class ("hot", "cold", "busy") over the deliveries to light clients."""
    classes = np.array(plan.classes)
    out = {}
    for name in sorted(set(plan.classes)):
        codes = np.flatnonzero(classes == name)
        lat = delivery_stats.latencies(light_log.select(np.isin(light_log.topic, codes)))
        if lat.size:  # the light clients may not take every class (busy topics are the dominator's)
            out[name] = delivery_stats.ms(delivery_stats.percentiles(lat))
    return out


def _sum_counters(counters: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counters:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """The headline figures of a summary, flat, in display order (also what ``compare`` prints).

    For a dominator run (two runs in one summary): the run with the dominator, plus the light clients'
    p99 without and with it.
    """
    if "dominator" in summary and "with" in summary:
        out = figures(summary["with"])
        dom = summary["dominator"]
        out["light p99 ms w/o dominator"] = dom["light_p99_ms_without"]
        out["light p99 ms with dominator"] = dom["light_p99_ms_with"]
        out["light p99 with/w/o"] = dom["p99_ratio"] or 0.0
        return out
    if "coldhot" in summary and "beside" in summary:
        out = figures(summary["beside"])
        pair = summary["coldhot"]
        out["cold p99 ms alone"] = pair["cold_p99_ms_alone"]
        out["cold p99 ms beside hot"] = pair["cold_p99_ms_beside"]
        out["cold p99 beside/alone"] = pair["p99_ratio"] or 0.0
        return out
    cpu = summary.get("cpu", {})
    delivered = summary["deliveries"]["total"]
    out = {
        "deliveries/s": summary["deliveries"]["per_s"],
        "published/s": summary["published"]["per_s"],
        "latency p50 ms": summary["latency_ms"]["p50"],
        "latency p90 ms": summary["latency_ms"]["p90"],
        "latency p99 ms": summary["latency_ms"]["p99"],
        "latency max ms": summary["latency_ms"]["max"],
        "skew p50 ms": summary["skew_ms"]["p50"],
        "skew p99 ms": summary["skew_ms"]["p99"],
        "announced loss": summary["loss"]["announced"],
        "silent loss": summary["loss"]["silent"],
        "undelivered": summary["loss"]["undelivered"],
        "jain (rate)": summary["fairness"]["jain_rate"],
        "jain (share)": summary["fairness"]["jain_share"],
        "entries/batch mean": summary["batch_entries"]["mean"],
        "server cpu %": cpu.get("server", {}).get("cpu_pct", 0.0),
        "server rss MB": cpu.get("server", {}).get("rss_max_mb", 0.0),
        "loadgen cpu %": cpu.get("loadgen", {}).get("cpu_pct", 0.0),
        "loadgen busiest proc %": cpu.get("loadgen", {}).get("busiest_pct", 0.0),
        "publisher cpu %": cpu.get("loadgen", {}).get("by_role_pct", {}).get("publisher", 0.0),
        "clients cpu %": cpu.get("loadgen", {}).get("by_role_pct", {}).get("clients", 0.0),
        "other cpu % (not ours)": cpu.get("machine", {}).get("other_pct", 0.0),
        # CPU seconds over the measured window (start of publishing to the end of the drain) per delivery
        "server cpu us/delivery": round(1e6 * cpu.get("server", {}).get("cpu_s", 0.0) / delivered, 3)
        if delivered else 0.0,
        "loadgen cpu us/delivery": round(1e6 * cpu.get("loadgen", {}).get("cpu_s", 0.0) / delivered, 3)
        if delivered else 0.0,
    }
    # TCP data segments the server sent its subscribers (0: not measured). On loopback the sending call pays
    # for both ends of a segment, so these two explain much of the server's CPU per delivery.
    sent = summary.get("server_segments") or 0
    out["server segments/delivery"] = round(sent / delivered, 3) if delivered else 0.0
    out["server cpu us/segment"] = round(1e6 * cpu.get("server", {}).get("cpu_s", 0.0) / sent, 3) if sent else 0.0
    for name, stats in summary.get("topic_classes_ms", {}).items():
        if len(summary["topic_classes_ms"]) > 1:
            out[f"{name} topics p99 ms"] = stats["p99"]
    return out
