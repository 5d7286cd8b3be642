"""Plots (matplotlib, Agg), the HTML report and the rich tables of a run."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadtest import analysis, delivery_stats  # noqa: E402
from loadtest.delivery_stats import DeliveryLog  # noqa: E402
from loadtest.scenarios import Plan  # noqa: E402

PLOTS = {
    "latency_cdf.png": "Publish to deliver latency (light clients)",
    "skew_cdf.png": "Visibility skew per message across clients",
    "deliveries_rate.png": "Deliveries per second",
    "topic_latency.png": "Latency per topic",
}
#: a CDF drawn from more points than this looks the same: subsample
CDF_POINTS = 20_000


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if values_ms.size == 0:
        return
    values = np.sort(values_ms)
    y = np.arange(1, values.size + 1) / values.size
    if values.size > CDF_POINTS:
        pick = np.linspace(0, values.size - 1, CDF_POINTS).astype(np.int64)
        values, y = values[pick], y[pick]
    ax.plot(values, y, label=label)


def _finish(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, log_x: bool = False) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_x:
        ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def light_log(log: DeliveryLog, plan: Plan) -> DeliveryLog:
    codes = [i for i, c in enumerate(plan.clients) if c.role == "light"]
    return log.select(np.isin(log.client, codes))


def write_plots(out: Path, log: DeliveryLog, plan: Plan, go_ns: int) -> dict[str, dict[str, float]]:
    """Write the PNGs of PLOTS into ``out``; returns the per-topic latency (ms) of the light clients."""
    light = light_log(log, plan)
    lat_ms = delivery_stats.latencies(light) / 1e6

    fig, ax = plt.subplots(figsize=(7, 4))
    positive = lat_ms[lat_ms > 0]
    _cdf(ax, positive, "light clients")
    stalled = [i for i, c in enumerate(plan.clients) if c.role != "light"]
    if stalled:
        other = delivery_stats.latencies(log.select(np.isin(log.client, stalled))) / 1e6
        _cdf(ax, other[other > 0], "stalled / dominator")
    ax.set_title(PLOTS["latency_cdf.png"])
    _finish(fig, ax, out / "latency_cdf.png", "latency (ms)", "fraction of deliveries", log_x=positive.size > 0)

    fig, ax = plt.subplots(figsize=(7, 4))
    skew_ms = delivery_stats.skews(light) / 1e6
    _cdf(ax, np.maximum(skew_ms, 1e-3), "messages seen by 2+ clients")
    ax.set_title(PLOTS["skew_cdf.png"])
    _finish(fig, ax, out / "skew_cdf.png", "max - min delivery time (ms)", "fraction of messages", log_x=skew_ms.size > 0)

    fig, ax = plt.subplots(figsize=(7, 4))
    t, rate = delivery_stats.rate_series(log.deliver_ns, go_ns, 0.1)
    ax.plot(t, rate, label="all clients")
    if len(light) != len(log):
        t2, rate2 = delivery_stats.rate_series(light.deliver_ns, go_ns, 0.1)
        ax.plot(t2, rate2, label="light clients")
    ax.set_title(PLOTS["deliveries_rate.png"])
    _finish(fig, ax, out / "deliveries_rate.png", "seconds since start", "deliveries/s (100 ms bins)")

    per_topic = {name: delivery_stats.ms(stats) for name, stats in delivery_stats.per_topic_latency(light).items()}
    fig, ax = plt.subplots(figsize=(max(7, min(20, len(plan.topics) * 0.08)), 4))
    classes = dict(zip(plan.topics, plan.classes))
    for cls, color in (("hot", "tab:red"), ("cold", "tab:blue"), ("busy", "tab:gray")):
        names = [n for n in plan.topics if classes[n] == cls and n in per_topic]
        if not names:
            continue
        x = [plan.topics.index(n) for n in names]
        ax.scatter(x, [per_topic[n]["p50"] for n in names], s=10, color=color, marker="o", label=f"{cls} p50")
        ax.scatter(x, [per_topic[n]["p99"] for n in names], s=10, color=color, marker="^", label=f"{cls} p99")
    ax.set_title(PLOTS["topic_latency.png"])
    _finish(fig, ax, out / "topic_latency.png", "topic (index)", "latency (ms)")
    return per_topic


def write_overlay(path: Path, logs: dict[str, Path]) -> None:
    """Latency CDFs of several runs on one plot, from their delivery logs (all clients); missing logs
    (a dominator run keeps its logs one level down) are left out."""
    from loadtest import deliverylog

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, log_path in logs.items():
        if log_path.exists():
            lat = delivery_stats.latencies(deliverylog.read(log_path)) / 1e6
            _cdf(ax, lat[lat > 0], label)
    ax.set_title("Publish to deliver latency, all clients")
    _finish(fig, ax, path, "latency (ms)", "fraction of deliveries", log_x=True)


def write(out: Path, log: DeliveryLog, summary: dict[str, Any], plan: Plan, go_ns: int) -> None:
    """Plots, ``topics.json`` and ``report.html`` of one run."""
    per_topic = write_plots(out, log, plan, go_ns)
    classes = dict(zip(plan.topics, plan.classes))
    (out / "topics.json").write_text(
        json.dumps({name: {"class": classes[name], **stats} for name, stats in per_topic.items()}, indent=1)
    )
    write_html(out / "report.html", summary, list(PLOTS))


def write_html(path: Path, summary: dict[str, Any], images: list[str]) -> None:
    title = f"{summary['scenario']['name']} against {summary['target']}"
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in analysis.figures(summary).items())
    figures = "".join(
        f'<figure><img src="{name}" alt="{html.escape(PLOTS.get(name, name))}">'
        f"<figcaption>{html.escape(PLOTS.get(name, name))}</figcaption></figure>"
        for name in images
    )
    body = json.dumps(summary, indent=2, default=str)
    path.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td{{border:1px solid #ccc;padding:2px 8px}}td:last-child{{text-align:right}}
figure{{display:inline-block;margin:1em}}pre{{background:#f6f6f6;padding:1em;font-size:80%}}</style>
</head><body><h1>{html.escape(title)}</h1>
<p>{html.escape(summary["scenario"].get("description", ""))}</p>
<table>{rows}</table>
{figures}
<h2>summary.json</h2><pre>{html.escape(body)}</pre>
</body></html>
""")


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and (value == 0 or abs(value) >= 100):
        value = int(value)  # a median of counts
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_summary(console: Console, summary: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in analysis.figures(summary).items():
        style = "bold red" if name == "silent loss" and value else None
        table.add_row(name, _fmt(value), style=style)
    console.print(table)
    clients = summary["clients"]
    console.print(
        f"clients {clients['ready']}/{clients['planned']} subscribed, {clients['closed_during_run']} "
        f"closed during the run; published {summary['published']['sent']:,} "
        f"({summary['published']['per_s']:,.0f}/s), delivered {summary['deliveries']['total']:,}; "
        f"loss by reason {summary['loss']['by_reason']}"
    )
    if summary["published"]["errors"]:
        console.print(f"[yellow]publisher errors: {summary['published']['errors']}")
    if summary["client_errors"]:
        console.print(f"[yellow]client errors: {summary['client_errors']}")


def print_comparison(
    console: Console,
    columns: dict[str, dict[str, float]] | dict[str, dict[str, float | None]],
    title: str,
    ratio: tuple[str, str] | None = None,
    ratio_columns: int = 0,
) -> None:
    """Figures side by side (every figure any column has, in first-seen order); with exactly two columns,
    also their ratio (``ratio`` = (numerator, denominator) labels, default first / second). The last
    ``ratio_columns`` columns are ratios already (printed to two decimals, "-" where undefined)."""
    labels = list(columns)
    table = Table(title=title)
    table.add_column("figure")
    for label in labels:
        table.add_column(label, justify="right")
    num, den = ratio or (labels[0], labels[-1])
    pair = len(labels) == 2 and not ratio_columns
    if pair:
        table.add_column(f"{num}/{den}", justify="right")
    names = list(dict.fromkeys(name for label in labels for name in columns[label]))
    first_ratio = len(labels) - ratio_columns
    for name in names:
        values = [columns[label].get(name) for label in labels]
        row = [name, *(("-" if v is None else (f"{v:.2f}" if i >= first_ratio else _fmt(v))) for i, v in enumerate(values))]
        if pair:
            a, b = columns[num].get(name), columns[den].get(name)
            row.append(f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-")
        table.add_row(*row)
    console.print(table)
