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
    #: (client, topic, since seq, subscribed seq, receive ns) per answered resubscribe (a reconnect storm)
    resumes: tuple[tuple[int, int, int, int, int], ...] = ()


def merge(dumps: list[dict[str, Any]], plan: Plan, published: dict[str, Any]) -> RunData:
    """Concatenate the worker dumps (rows of a client stay in arrival order)."""
    types = {
        "topic": np.int32,
        "client": np.int32,
        "seq": np.int64,
        "publish_ns": np.int64,
        "deliver_ns": np.int64,
        "batch_id": np.int64,
    }
    columns = {
        name: np.concatenate([np.frombuffer(d["arrays"][name], dtype) for d in dumps]) if dumps else np.zeros(0, dtype)
        for name, dtype in types.items()
    }
    log = DeliveryLog(
        plan.topics,
        tuple(c.name for c in plan.clients),
        columns["topic"],
        columns["seq"],
        columns["client"],
        columns["publish_ns"],
        columns["deliver_ns"],
        columns["batch_id"],
    )
    losses = [row for d in dumps for row in d["losses"] if row[1] >= 0]
    notices = Notices(
        np.array([r[0] for r in losses], np.int32),
        np.array([r[1] for r in losses], np.int32),
        np.array([r[2] for r in losses], np.int64),
        np.array([r[3] for r in losses], np.int64),
        tuple(r[4] for r in losses),
    )
    starts: dict[tuple[int, int], int] = {}
    clients: dict[int, dict[str, Any]] = {}
    for d in dumps:
        starts.update(d["starts"])
        clients.update(d["clients"])
    resumes = tuple(r for d in dumps for r in d.get("resumes", ()))
    return RunData(log, notices, starts, clients, published, dumps, resumes)


def _role_codes(plan: Plan, role: str) -> np.ndarray:
    return np.array([i for i, c in enumerate(plan.clients) if c.role == role], np.int64)


def summarize(data: RunData, scenario: Scenario, plan: Plan, target: str, go_ns: int, stall_resumes: bool) -> dict[str, Any]:
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
        role_notices = Notices(
            data.notices.client[mask_n],
            data.notices.topic[mask_n],
            data.notices.start[mask_n],
            data.notices.end[mask_n],
            tuple(r for r, m in zip(data.notices.reason, mask_n) if m),
        )
        role_starts = {k: v for k, v in data.starts.items() if plan.clients[k[0]].role == role}
        figures = delivery_stats.loss_figures(
            log.select(np.isin(log.client, codes)), role_notices, role_starts, expected_end, reading
        )
        loss_by_role[role] = dataclasses.asdict(figures)

    # fairness over the light clients that were ready: raw delivery counts, and the share of what was
    # published on their own topics (1.0 each when nobody misses anything)
    light_ready = np.array([c for c in light if c in ready], np.int64)
    counts = delivery_stats.per_client_counts(light_log, len(plan.clients))[light_ready] if light_ready.size else np.zeros(0)
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
            by_transport[transport] = delivery_stats.ms(
                delivery_stats.percentiles(delivery_stats.latencies(light_log.select(np.isin(light_log.client, codes))))
            )

    stalled_codes = _role_codes(plan, "stalled")
    publish_s = max(1e-9, (data.published.get("last_ns", go_ns) - data.published.get("first_ns", go_ns)) / 1e9)
    summary: dict[str, Any] = {
        "scenario": dataclasses.asdict(scenario),
        "target": target,
        "clients": {
            "planned": len(plan.clients),
            "ready": len(ready),
            "failed": len(plan.clients) - len(ready),
            "closed_during_run": len(closed),
            "closed_by_role": {r: sum(1 for c in closed if plan.clients[c].role == r) for r in ("light", "stalled", "dominator")},
            "first_errors": sorted({st["error"] for st in data.clients.values() if st.get("error")})[:5],
            "close_reasons": sorted({st["closed_reason"] for st in data.clients.values() if st.get("closed_reason")})[:5],
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
            "total": len(log),
            "light": len(light_log),
            "per_s": round(len(log) / (window_ns / 1e9), 1) if window_ns > 0 else 0.0,
            "peak_per_s": float(series.max()) if series.size else 0.0,
            "frames": int(sum(w["frames"] for w in data.workers)),
            "dropped_rows": int(sum(w["dropped_rows"] for w in data.workers)),
            "foreign": int(sum(w["foreign"] for w in data.workers)),
            "window_s": round(window_ns / 1e9, 3),
        },
        "latency_ms": delivery_stats.ms(delivery_stats.percentiles(lat)),
        "latency_ms_by_transport": by_transport,
        "latency_ms_stalled": delivery_stats.ms(
            delivery_stats.percentiles(delivery_stats.latencies(log.select(np.isin(log.client, stalled_codes))))
        )
        if stalled_codes.size
        else {},
        "skew_ms": delivery_stats.ms(delivery_stats.percentiles(skew)),
        # per publish: until the last of its subscribers (light clients) had it
        "time_to_last_ms": delivery_stats.ms(delivery_stats.percentiles(delivery_stats.time_to_last(light_log))),
        "loss": dataclasses.asdict(loss),
        "loss_by_role": loss_by_role,
        "fairness": {
            "jain_rate": round(delivery_stats.jain(counts), 4),
            "jain_share": round(delivery_stats.jain(shares), 4),
            "clients": int(light_ready.size),
            "share_min": round(float(shares.min()), 4) if shares.size else 0.0,
        },
        "batch_entries": {k: (v if k == "n" else round(v, 2)) for k, v in delivery_stats.percentiles(sizes).items()},
        "topic_classes_ms": classes,
        "client_errors": _sum_counters(w["errors"] for w in data.workers),
        "client_error_samples": [s for w in data.workers for s in w["error_samples"]][:10],
    }
    if scenario.storm_at is not None:
        summary["storm"] = storm_figures(data, scenario, loss)
    if "dominator" in {c.role for c in plan.clients}:
        dom = _role_codes(plan, "dominator")
        summary["latency_ms_dominator"] = delivery_stats.ms(
            delivery_stats.percentiles(delivery_stats.latencies(log.select(np.isin(log.client, dom))))
        )
    return summary


def storm_figures(data: RunData, scenario: Scenario, loss: delivery_stats.LossFigures) -> dict[str, Any]:
    """A reconnect storm's figures from the clients' storm states and the delivery log.

    A client is *back* when every topic is subscribed again (its resubscribes' ``subscribed`` entries came),
    and *caught up* once it also received the last of the messages published before its resubscribe left
    (the replay from ``since``). ``ok`` holds when every stormed client came back, every resubscribe was
    answered at the seq it named, and the whole run has no gap (silent, announced, epoch reset or
    undelivered) and no duplicate.
    """
    stormed = {c: st["storm"] for c, st in data.clients.items() if st.get("storm")}
    if not stormed:
        return {"clients": 0, "back": 0, "not_back": 0, "ok": False, "error": "no client was stormed"}
    n = max(max(stormed) + 1, len(data.clients))
    storm_ns = min(st["storm_ns"] for st in stormed.values())
    back = {c: st for c, st in stormed.items() if st["back_ns"]}
    open_ns, resub_ns = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for c, st in back.items():
        open_ns[c], resub_ns[c] = st["open_ns"], st["resub_ns"]
    log = data.log
    client = log.client.astype(np.int64)
    replay = (
        (open_ns[client] > 0) & (log.deliver_ns >= open_ns[client]) & (log.publish_ns >= 0) & (log.publish_ns < resub_ns[client])
    )
    caught = np.zeros(n, np.int64)
    np.maximum.at(caught, client[replay], log.deliver_ns[replay])
    for c, st in back.items():
        caught[c] = max(int(caught[c]), st["back_ns"])
    back_codes = np.array(sorted(back), np.int64)
    opens = np.array([st["open_ns"] for st in back.values()], np.int64)
    first_try = (
        min(st["retry_ns"] for st in stormed.values() if st["retry_ns"])
        if any(st["retry_ns"] for st in stormed.values())
        else storm_ns
    )
    accept_s = (int(opens.max()) - first_try) / 1e9 if opens.size else 0.0
    attempts = sum(st["attempts"] for st in stormed.values())
    mismatched = sum(1 for _c, _t, since, seq, _ns in data.resumes if seq != since)
    gaps = loss.silent + loss.announced + loss.epoch_resets + loss.undelivered
    reconnect = np.array([st["back_ns"] - st["retry_ns"] for st in back.values()], np.int64)
    out: dict[str, Any] = {
        "clients": len(stormed),
        "back": len(back),
        "not_back": len(stormed) - len(back),
        "spread_s": scenario.storm_spread,
        # the headline: from the storm until the last client was back and had its replay
        "last_caught_up_s": round((int(caught[back_codes].max()) - storm_ns) / 1e9, 3) if back else None,
        "last_back_s": round((max(st["back_ns"] for st in back.values()) - storm_ns) / 1e9, 3) if back else None,
        "caught_up_s": {
            k: (v if k == "n" else round(v / 1e9, 3))
            for k, v in delivery_stats.percentiles(caught[back_codes] - storm_ns).items()
        }
        if back
        else {},
        # one client's comeback, from its first attempt until every topic was subscribed again
        "reconnect_ms": delivery_stats.ms(delivery_stats.percentiles(reconnect)),
        "accept_per_s": {
            "offered": round(len(stormed) / scenario.storm_spread, 1) if scenario.storm_spread else None,
            "mean": round(opens.size / accept_s, 1) if accept_s > 0 else None,
            "peak_1s": delivery_stats.window_peak(opens, 1_000_000_000),
        },
        "attempts": attempts,
        "failed_attempts": attempts - len(back),
        "first_errors": sorted({st["error"] for st in stormed.values() if st["error"]})[:5],
        "resubscribes": len(data.resumes),
        "since_mismatch": mismatched,
        "replayed": int(np.count_nonzero(replay)),
        "gaps": gaps,
        "duplicates": loss.duplicates,
    }
    out["ok"] = bool(out["not_back"] == 0 and mismatched == 0 and gaps == 0 and loss.duplicates == 0)
    return out


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
        # one publish until the last of its subscribers had it: median and worst over the publishes
        "time to last p50 ms": summary.get("time_to_last_ms", {}).get("p50", 0.0),
        "time to last max ms": summary.get("time_to_last_ms", {}).get("max", 0.0),
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
        "server rss KB/conn": cpu.get("server", {}).get("rss_per_conn_kb", 0.0),
        "server rss KB/conn (run max)": cpu.get("server", {}).get("rss_per_conn_run_kb", 0.0),
        "loadgen cpu %": cpu.get("loadgen", {}).get("cpu_pct", 0.0),
        "loadgen busiest proc %": cpu.get("loadgen", {}).get("busiest_pct", 0.0),
        "publisher cpu %": cpu.get("loadgen", {}).get("by_role_pct", {}).get("publisher", 0.0),
        "clients cpu %": cpu.get("loadgen", {}).get("by_role_pct", {}).get("clients", 0.0),
        "other cpu % (not ours)": cpu.get("machine", {}).get("other_pct", 0.0),
        # CPU seconds over the measured window (start of publishing to the end of the drain) per delivery
        "server cpu us/delivery": round(1e6 * cpu.get("server", {}).get("cpu_s", 0.0) / delivered, 3) if delivered else 0.0,
        "loadgen cpu us/delivery": round(1e6 * cpu.get("loadgen", {}).get("cpu_s", 0.0) / delivered, 3) if delivered else 0.0,
    }
    # TCP data segments the server sent its subscribers (0: not measured). On loopback the sending call pays
    # for both ends of a segment, so these two explain much of the server's CPU per delivery.
    sent = summary.get("server_segments") or 0
    out["server segments/delivery"] = round(sent / delivered, 3) if delivered else 0.0
    out["server cpu us/segment"] = round(1e6 * cpu.get("server", {}).get("cpu_s", 0.0) / sent, 3) if sent else 0.0
    # bytes the WebSocket clients read per delivery: frames with their headers, compressed where negotiated
    out["wire bytes/delivery"] = summary.get("wire", {}).get("per_delivery") or 0.0
    if "broker" in cpu:  # server.workers > 1: Redis, beside (not in) the server's figures
        out["broker cpu us/delivery"] = round(1e6 * cpu["broker"].get("cpu_s", 0.0) / delivered, 3) if delivered else 0.0
    storm = summary.get("storm")
    if storm:
        out["storm last caught up s"] = storm["last_caught_up_s"] or 0.0
        out["storm not back"] = storm["not_back"]
        out["storm accepts/s mean"] = storm["accept_per_s"]["mean"] or 0.0
        out["storm accepts/s peak 1s"] = storm["accept_per_s"]["peak_1s"]
        out["storm gaps"] = storm["gaps"]
        out["storm duplicates"] = storm["duplicates"]
    for name, stats in summary.get("topic_classes_ms", {}).items():
        if len(summary["topic_classes_ms"]) > 1:
            out[f"{name} topics p99 ms"] = stats["p99"]
    return out
