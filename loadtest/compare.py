"""``python -m loadtest compare SCENARIO``: the same scenario against the gateway and nginx + nchan (and,
with ``--targets``, the bare reference server or the gateway with more workers).

Runs alternate (gateway, nchan, gateway, nchan, ...) so that drift of the machine hits all alike; each
figure is the median over the rounds, printed for every target with each one's ratio to nchan.

``python -m loadtest depths SCENARIO --depths 1,8,auto``: the same scenario against the gateway at several
ring batch depths (``batch_depth``), alternating in the same way (1, 8, auto, 1, 8, auto, ...).

``python -m loadtest baseline SCENARIO --bare-batches 1,8``: the gateway against the bare reference server
(loadtest/bare_server.py) at each batch, alternating; the ratios gateway / bare say how far the gateway is
from what plain Python on uvloop does with no scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest import analysis, nchan, report, runner
from loadtest.scenarios import Scenario


def compare(
    scenario: Scenario,
    gateway: runner.TargetFactory,
    out: Path,
    rounds: int = 1,
    console: Console | None = None,
    progress: bool = True,
    others: dict[str, runner.TargetFactory] | None = None,
    with_nchan: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Run ``scenario`` against the gateway, nginx + nchan (unless not ``with_nchan``) and ``others`` (label ->
    factory: the bare server, the gateway with more workers), alternating, and print each figure's median per
    target with the ratio of every other target to nchan (to the gateway without nchan)."""
    console = console or Console()
    if with_nchan:
        nchan.ensure_installed(console)
    if scenario.batch_depth != 1 or scenario.linger:
        console.print(
            f"gateway: batch_depth {scenario.batch_depth}, linger {scenario.linger} s; nchan has no "
            "equivalent (one message per WebSocket frame, sent at once)"
        )
    factories: dict[str, runner.TargetFactory] = {"gateway": gateway}
    if with_nchan:
        factories["nchan"] = lambda workdir: nchan.NchanServer(
            workdir, scenario.capacity, deflate=scenario.compression == "deflate"
        )
    factories.update(others or {})
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in factories}
    for r in range(rounds):
        for label, factory in factories.items():
            console.rule(f"round {r + 1}/{rounds}: {label}")
            summary = runner.run(scenario, factory, out / f"{label}-{r + 1}", console, progress, **options)
            runs[label].append(analysis.figures(summary))
    medians = _medians(runs, console)
    base = "nchan" if with_nchan else "gateway"
    columns: dict[str, dict[str, float | None]] = dict(medians)  # type: ignore[arg-type]
    for label in medians:
        if label != base:
            columns[f"{label}/{base}"] = ratios(medians[label], medians[base])
    depth = f", gateway batch depth {scenario.batch_depth}" if scenario.batch_depth != 1 else ""
    depth += f", linger {scenario.linger} s" if scenario.linger else ""
    report.print_comparison(
        console,
        columns,
        f"{scenario.name}: {' vs '.join(factories)} (median of {rounds} round{'s' * (rounds > 1)}{depth})",
        ratio_columns=len(columns) - len(medians),
    )
    report.write_overlay(
        out / "compare_latency_cdf.png", {label: out / f"{label}-1" / "deliveries.parquet" for label in factories}
    )
    result = {
        "scenario": scenario.name,
        "rounds": rounds,
        "batch_depth": scenario.batch_depth,
        "settings": dataclasses.asdict(scenario),
        "targets": list(factories),
        "median": medians,
        "ratios": {label: columns[label] for label in columns if label not in medians},
        "runs": runs,
    }
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    console.print(f"results in {out}")
    return result


def compare_depths(
    scenario: Scenario,
    depths: list[int | str],
    gateway: Callable[[int | str], runner.TargetFactory],
    out: Path,
    rounds: int = 1,
    console: Console | None = None,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Run ``scenario`` against the gateway once per batch depth per round, alternating; ``gateway(depth)``
    makes the target factory. Prints the medians side by side, each depth's ratio to the first one, and
    writes ``depths.json`` (every round's figures)."""
    console = console or Console()
    labels = {depth: f"depth {depth}" for depth in depths}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in labels.values()}
    for r in range(rounds):
        for depth, label in labels.items():
            console.rule(f"round {r + 1}/{rounds}: {label}")
            run = dataclasses.replace(scenario, batch_depth=depth)
            summary = runner.run(run, gateway(depth), out / f"depth-{depth}-{r + 1}", console, progress, **options)
            runs[label].append(analysis.figures(summary))
    medians = _medians(runs, console)
    first = next(iter(medians))
    columns = dict(medians)
    for label in list(medians)[1:]:
        columns[f"{label}/{first}"] = {
            name: (value / medians[first][name] if medians[first][name] else 0.0) for name, value in medians[label].items()
        }
    report.print_comparison(
        console, columns, f"{scenario.name}: gateway batch depths (median of {rounds} round{'s' * (rounds > 1)})"
    )
    result = {
        "scenario": scenario.name,
        "rounds": rounds,
        "depths": depths,
        "settings": dataclasses.asdict(scenario),
        "median": medians,
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "depths.json").write_text(json.dumps(result, indent=2))
    console.print(f"results in {out}")
    return result


def compare_baseline(
    scenario: Scenario,
    gateway: runner.TargetFactory,
    batches: list[int],
    out: Path,
    rounds: int = 1,
    console: Console | None = None,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Run ``scenario`` against the gateway and the bare reference server (loadtest/bare_server.py) at each
    of ``batches`` messages per frame, alternating (gateway, bare 1, bare 8, gateway, ...). Prints the
    medians side by side with the ratio gateway / bare for each batch, and writes ``baseline.json``."""
    from loadtest.bare_server import BareServer

    console = console or Console()
    factories: dict[str, runner.TargetFactory] = {"gateway": gateway}

    def bare(batch: int) -> runner.TargetFactory:
        return lambda workdir: BareServer(workdir, batch)

    for batch in batches:
        factories[f"bare {batch}"] = bare(batch)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in factories}
    for r in range(rounds):
        for label, factory in factories.items():
            console.rule(f"round {r + 1}/{rounds}: {label}")
            summary = runner.run(scenario, factory, out / f"{label.replace(' ', '-')}-{r + 1}", console, progress, **options)
            runs[label].append(analysis.figures(summary))
    medians = _medians(runs, console)
    columns = dict(medians)
    for label in list(medians)[1:]:
        columns[f"gateway/{label}"] = {
            name: (value / medians[label][name] if medians[label].get(name) else 0.0)
            for name, value in medians["gateway"].items()
        }
    depth = f", gateway batch depth {scenario.batch_depth}" if scenario.batch_depth != 1 else ""
    report.print_comparison(
        console,
        columns,
        f"{scenario.name}: gateway vs the bare server at {batches} "
        f"messages per frame (median of {rounds} round"
        f"{'s' * (rounds > 1)}{depth})",
    )
    result = {
        "scenario": scenario.name,
        "rounds": rounds,
        "bare_batches": batches,
        "batch_depth": scenario.batch_depth,
        "settings": dataclasses.asdict(scenario),
        "median": medians,
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "baseline.json").write_text(json.dumps(result, indent=2))
    console.print(f"results in {out}")
    return result


def ratios(values: dict[str, float], base: dict[str, float]) -> dict[str, float | None]:
    """Each figure of ``values`` divided by the same figure of ``base`` (None where that one is 0 or missing)."""
    return {name: (round(value / base[name], 3) if base.get(name) else None) for name, value in values.items()}


#: A load process this busy (% of one core) is reading as fast as it can: what it measures is partly itself.
SATURATED_PCT = 90.0


def _medians(runs: dict[str, list[dict[str, float]]], console: Console) -> dict[str, dict[str, float]]:
    """Each target's median of each figure over its rounds; warns of a target whose load saturated a core."""
    medians = {
        label: {name: statistics.median(f[name] for f in figures) for name in figures[0]} for label, figures in runs.items()
    }
    for label, figures in medians.items():
        busiest = figures.get("loadgen busiest proc %", 0.0)
        if busiest >= SATURATED_PCT:
            console.print(
                f"[yellow]against {label} the busiest load process ran at {busiest:.0f}% of a core: "
                "its latency and CPU figures are partly the load tool's; spread the clients with "
                "--procs N (docs/loadtest.md)"
            )
    return medians
