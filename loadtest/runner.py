"""One load run from start to results: publisher and client processes, progress, drain, figures, files.

Phases, each with its own time limit, so that every run stops by itself:

1. the publisher process connects and publishes one priming message per topic (``PRIME_TIMEOUT``);
2. the client processes connect and subscribe (``connect_timeout``);
3. everyone is told the same start time; the publisher publishes for ``duration`` seconds or ``messages``
   messages, whichever comes first (the publisher is abandoned ``PUBLISH_GRACE`` seconds after that);
4. drain: wait until the clients still reading got (or were told they lost) everything, or until no
   delivery arrived for ``QUIET`` seconds, at most ``scenario.drain`` seconds;
5. the clients close and hand in their logs; the figures and files are written.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import time
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from loadtest import analysis, deliverylog, publisher, recorder, report, segments, worker
from loadtest.book import BOOK
from loadtest.procstat import MachineSampler, TreeSampler, peak_rss, raise_nofile_limit, tree_rss, wait_quiet
from loadtest.scenarios import Plan, Scenario, plan
from loadtest.target import Target

PRIME_TIMEOUT = 30.0
#: extra seconds for the ready handshake beyond the clients' own connect timeout
READY_SLACK = 15.0
PUBLISH_GRACE = 30.0
#: no new delivery for this long after publishing ends: nothing more is coming
QUIET = 1.0
#: clients write their logs: generous, a big run pickles hundreds of MB
DONE_TIMEOUT = 120.0
#: publishing starts this long after the go message, so that every process hears it in time
GO_DELAY = 0.3
SAMPLE_PERIOD = 0.25

TargetFactory = Callable[[Path], AbstractContextManager[Target]]


def _recv(conn: Connection, timeout: float, what: str) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from the {what} after {timeout:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the {what} exited (its traceback is above)") from None


def _split(items: tuple[Any, ...], parts: int) -> list[tuple[Any, ...]]:
    return [items[i::parts] for i in range(parts)]


class LoadRun:
    """Drives one run against a live target; :meth:`execute` returns the summary dict."""

    def __init__(
        self,
        scenario: Scenario,
        target: Target,
        out: Path,
        console: Console,
        progress: bool,
        connect_timeout: float = 20.0,
        max_rows: int = recorder.DEFAULT_MAX_ROWS,
    ) -> None:
        self.scenario = scenario
        self.plan: Plan = plan(scenario)
        self.target = target
        self.out = out
        self.console = console
        self.progress = progress
        self.connect_timeout = connect_timeout
        self.max_rows = max_rows
        self.ctx = mp.get_context("spawn")
        self.processes: list[Any] = []
        self.pipes: list[Connection] = []

    def execute(self) -> dict[str, Any]:
        raise_nofile_limit()
        try:
            return self._execute()
        except BaseException:
            for conn in self.pipes:  # let the processes end on their own before they are terminated
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
            raise
        finally:
            for proc in self.processes:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=5)

    def _start(self, main: Callable[..., None], *args: Any, name: str) -> Connection:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=main, args=(*args, child), name=name, daemon=True)
        proc.start()
        child.close()
        self.processes.append(proc)
        self.pipes.append(parent)
        return parent

    def _execute(self) -> dict[str, Any]:
        s, p, target = self.scenario, self.plan, self.target
        stall_at, stall_for = s.resolved_stall()
        pub_counter = self.ctx.RawArray("q", 1)
        procs = min(s.procs, len(p.clients))
        counters = self.ctx.RawArray("q", procs * len(worker.COUNTERS))
        closed_loop = s.rate is None and s.window > 0
        # closed loop: the publisher keeps window x (subscriptions of the clients that read) in flight,
        # counted from the clients' shared counters (the "light" side: everyone but stalled clients)
        fanout = [0] * len(p.topics)
        for c in p.clients:
            if c.role != "stalled":
                for t in c.topics:
                    fanout[t] += 1
        pub_spec = publisher.PublisherSpec(
            target,
            p.topics,
            p.rates,
            s.rate is not None,
            s.duration,
            s.messages,
            s.payload,
            s.publish_via,
            window=s.window * sum(fanout) if closed_loop else 0,
            fanout=tuple(fanout),
            procs=procs,
        )
        pub = self._start(publisher.main, pub_spec, pub_counter, counters, name="loadtest-publisher")
        # the client processes start (imports take a while) while the publisher primes the topics
        workers = []
        indexed = tuple(enumerate(p.clients))
        period = worker.FAST_COUNTER_PERIOD if closed_loop else worker.COUNTER_PERIOD
        for slot, part in enumerate(_split(indexed, procs)):
            spec = worker.WorkerSpec(
                slot,
                target,
                p.topics,
                part,
                len(p.clients),
                stall_at,
                stall_for,
                str(self.out / f"worker{slot}.pickle"),
                self.connect_timeout,
                self.max_rows,
                period,
                s.source_addrs,
                s.storm_at,
                s.storm_spread,
                s.seed,
                s.compression,
                s.delta,
                s.payload == BOOK,
                s.protocol,
            )
            workers.append(self._start(worker.main, spec, counters, name=f"loadtest-clients{slot}"))
        _, error = _recv(pub, PRIME_TIMEOUT, "publisher")
        if error:
            raise RuntimeError(f"publisher could not start: {error}")
        # the server's memory before the clients and with them connected and subscribed: RSS per connection
        rss_before = tree_rss(target.pid) if target.pid else 0
        for conn in workers:
            conn.send(("connect",))
        ready = failed = 0
        first_error = ""
        for conn in workers:
            _, n_ready, n_failed, error = _recv(conn, self.connect_timeout + READY_SLACK, "client workers")
            ready, failed = ready + n_ready, failed + n_failed
            first_error = first_error or error
        if not ready:
            raise RuntimeError(f"no client could connect and subscribe: {first_error}")
        if failed:
            self.console.print(f"[yellow]{failed} of {ready + failed} clients not subscribed: {first_error}")

        rss_connected = tree_rss(target.pid) if target.pid else 0
        server = TreeSampler(target.pid) if target.pid else None
        broker = TreeSampler(target.broker_pid) if target.broker_pid else None
        loadgen = TreeSampler(os.getpid(), exclude=tuple(pid for pid in (target.pid, target.broker_pid) if pid))
        machine = MachineSampler()
        segments_before = segments.read(target.http_port)
        go_ns = time.time_ns() + int(GO_DELAY * 1e9)
        for conn in [pub, *workers]:
            conn.send(("go", go_ns))
        t_go = time.monotonic() + GO_DELAY

        def sample() -> None:
            if server is not None:
                server.sample()
            if broker is not None:
                broker.sample()
            loadgen.sample()
            machine.sample()

        def totals() -> dict[str, int]:
            n = len(worker.COUNTERS)
            return {name: sum(counters[i * n + k] for i in range(procs)) for k, name in enumerate(worker.COUNTERS)}

        # what the WebSocket clients read before publishing starts (handshakes, `subscribed`) is not counted
        wire_at_go = totals()["wire_bytes"]
        published: dict[str, Any] = {}
        with self._progress() as bar:
            task = bar.add_task("publishing", total=s.duration)
            deadline = t_go + s.duration + PUBLISH_GRACE
            last_rate_check = (time.monotonic(), 0)
            rate = 0.0
            while time.monotonic() < deadline:
                if pub.poll(SAMPLE_PERIOD):
                    _, published = _recv(pub, 0, "publisher")
                    break
                sample()
                now, tot = time.monotonic(), totals()
                delivered = tot["msgs_light"] + tot["msgs_stalled"]
                if now - last_rate_check[0] >= 1.0:
                    rate = (delivered - last_rate_check[1]) / (now - last_rate_check[0])
                    last_rate_check = (now, delivered)
                bar.update(
                    task,
                    completed=min(s.duration, max(0.0, now - t_go)),
                    description=self._status(pub_counter[0], delivered, rate, tot, server),
                )
            else:
                self.console.print("[red]publisher did not finish in time; abandoning it")
            bar.update(task, completed=s.duration)

            # drain
            accepted = published.get("accepted", {})
            index = p.topic_index()
            per_topic = [0] * len(p.topics)
            for t, n in accepted.items():
                per_topic[index[t]] = n
            reading = [c for c in p.clients if c.role != "stalled" or stall_for > 0]
            expected = sum(per_topic[t] for c in reading for t in c.topics)
            drain_task = bar.add_task("draining", total=max(expected, 1))
            t_drain, last_total, t_change = time.monotonic(), -1, time.monotonic()
            while time.monotonic() - t_drain < s.drain:
                sample()
                tot = totals()
                got = tot["msgs_light"] + tot["lost_light"]
                if stall_for > 0:
                    got += tot["msgs_stalled"] + tot["lost_stalled"]
                total = tot["msgs_light"] + tot["msgs_stalled"]
                if total != last_total:
                    last_total, t_change = total, time.monotonic()
                bar.update(drain_task, completed=min(got, expected))
                if got >= expected or time.monotonic() - t_change >= QUIET:
                    break
                time.sleep(0.1)
            sample()
            t_end = time.monotonic()
            segments_after = segments.read(target.http_port)

        for conn in workers:
            conn.send(("stop",))
        dumps = []
        for conn in workers:
            _, path = _recv(conn, DONE_TIMEOUT, "client workers")
            dumps.append(recorder.load(Path(path)))
            Path(path).unlink()

        data = analysis.merge(dumps, p, published)
        summary = analysis.summarize(data, s, p, target.kind, go_ns, stall_for > 0)
        end = totals()  # the workers' last counts, copied as they stopped
        delivered = end["msgs_light"] + end["msgs_stalled"]
        # bytes the WebSocket clients read (the server's TCP payload to them: frames, headers, compressed
        # where negotiated) per message delivered
        summary["wire"] = {
            "bytes": end["wire_bytes"] - wire_at_go,
            "per_delivery": round((end["wire_bytes"] - wire_at_go) / delivered, 1) if delivered else None,
            "compression": s.compression,
            "delta": s.delta,
            "payload": s.payload,
        }
        summary["cpu"] = self._cpu(server, loadgen, machine, t_go, t_end, dumps, published)
        if broker is not None:
            summary["cpu"]["broker"] = broker.window(t_go, t_end)
        if "server" in summary["cpu"] and ready:
            run_max = max((rss for _t, _c, rss in server.samples), default=0) if server is not None else 0
            summary["cpu"]["server"].update(
                rss_before_mb=round(rss_before / 2**20, 1),
                rss_connected_mb=round(rss_connected / 2**20, 1),
                # KB of server memory per client connected and subscribed; and at the run's largest
                rss_per_conn_kb=round((rss_connected - rss_before) / 1024 / ready, 2),
                rss_per_conn_run_kb=round((max(run_max, rss_connected) - rss_before) / 1024 / ready, 2),
            )
        # TCP data segments the server sent to its WebSocket clients (None: `ss` unavailable)
        summary["server_segments"] = segments.sent_between(segments_before, segments_after)
        summary["timing"] = {
            "go_ns": go_ns,
            "publish_s": round((published.get("last_ns", go_ns) - published.get("first_ns", go_ns)) / 1e9, 3),
            "measured_s": round(t_end - t_go, 3),
        }
        self._write(data, summary, go_ns)
        return summary

    def _progress(self) -> Progress:
        return Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
            disable=not self.progress,
        )

    def _status(self, sent: int, delivered: int, rate: float, tot: dict[str, int], server: TreeSampler | None) -> str:
        text = f"published {sent:,}  delivered {delivered:,} ({rate:,.0f}/s)"
        if tot["lost_light"] or tot["lost_stalled"]:
            text += f"  lost {tot['lost_light'] + tot['lost_stalled']:,}"
        if tot["closed"]:
            text += f"  closed {tot['closed']}"
        if server is not None and len(server.samples) >= 2:
            (t0, c0, _), (t1, c1, rss) = server.samples[-2], server.samples[-1]
            text += f"  server cpu {100 * (c1 - c0) / max(t1 - t0, 1e-9):.0f}% rss {rss / 2**20:.0f}MB"
        return text

    def _cpu(
        self,
        server: TreeSampler | None,
        loadgen: TreeSampler,
        machine: MachineSampler,
        t0: float,
        t1: float,
        dumps: list[dict[str, Any]],
        published: dict[str, Any],
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"loadgen": loadgen.window(t0, t1)}
        out["loadgen"]["procs"] = len(dumps) + 1
        # the publisher is the first process started, the client workers the rest
        pids = [proc.pid for proc in self.processes]
        out["loadgen"]["by_role_pct"] = {
            "runner": loadgen.pids_pct(t0, t1, [os.getpid()]),
            "publisher": loadgen.pids_pct(t0, t1, pids[:1]),
            "clients": loadgen.pids_pct(t0, t1, pids[1:]),
            "busiest_client_proc": max((loadgen.pids_pct(t0, t1, [p]) for p in pids[1:]), default=0.0),
        }
        out["loadgen"]["client_rss_max_mb"] = round(max((d["maxrss_kb"] for d in dumps), default=0) / 1024, 1)
        if server is not None and self.target.pid:
            out["server"] = server.window(t0, t1)
            out["server"]["rss_peak_mb"] = round(peak_rss(self.target.pid) / 2**20, 1)
        out["cores"] = os.cpu_count()
        busy = machine.window(t0, t1)
        ours = out["loadgen"]["cpu_pct"] + out.get("server", {}).get("cpu_pct", 0.0)
        # busy CPU of the whole machine (% of one core, up to cores x 100) and what neither server nor load
        # used: other programs (or the kernel's softirq work not charged to our processes)
        out["machine"] = {"busy_pct": busy, "other_pct": round(max(0.0, busy - ours), 1)}
        return out

    def _write(self, data: analysis.RunData, summary: dict[str, Any], go_ns: int) -> None:
        out, p = self.out, self.plan
        deliverylog.write(out / "deliveries.parquet", data.log)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        clients = [
            {**dataclasses.asdict(c), "topics": [p.topics[t] for t in c.topics], **data.clients.get(i, {})}
            for i, c in enumerate(p.clients)
        ]
        (out / "clients.json").write_text(json.dumps(clients, indent=1))
        report.write(out, data.log, summary, p, go_ns)


def _quiet(console: Console, limit_s: float) -> None:
    """Wait up to ``limit_s`` for the machine to be quiet before a run (``--wait-quiet``)."""
    if limit_s <= 0:
        return
    quiet, busy = wait_quiet(limit_s)
    if not quiet:
        console.print(f"[yellow]the machine is still busy ({busy:.0f}% of a core) after {limit_s:g} s; running anyway")


#: the halves of a paired run: a dominator run (without, with) and a coldhot run (alone, beside)
PAIRS = ("without", "with", "alone", "beside")


def run(
    scenario: Scenario,
    target_factory: TargetFactory,
    out: Path,
    console: Console | None = None,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Run a scenario against a fresh target from ``target_factory`` and write its results under ``out``.

    A scenario with a dominator (``dominator_topics > 0``) runs twice, without then with the dominator
    client, in ``out/without`` and ``out/with``; the top summary compares the light clients' latency.
    A ``coldhot`` scenario runs twice, its hot topics silent then published, in ``out/alone`` and
    ``out/beside``; the top summary compares the cold topics' latency.
    """
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    options.setdefault("wait_quiet", 0.0)
    if scenario.dominator_topics:
        return _run_dominator(scenario, target_factory, out, console, progress, **options)
    if scenario.coldhot:
        return _run_coldhot(scenario, target_factory, out, console, progress, **options)
    console.print(f"[bold]{scenario.name}[/]: {scenario.description}")
    wait = options.pop("wait_quiet")
    _quiet(console, wait)
    with target_factory(out) as target:
        summary = LoadRun(scenario, target, out, console, progress, **options).execute()
    report.print_summary(console, summary, f"{scenario.name} against {summary['target']}")
    console.print(f"results in {out}")
    return summary


def _run_pair(
    scenario: Scenario,
    target_factory: TargetFactory,
    out: Path,
    console: Console,
    progress: bool,
    halves: tuple[tuple[str, str, Scenario], tuple[str, str, Scenario]],
    **options: Any,
) -> dict[str, dict[str, Any]]:
    """Two runs on fresh targets, each in its own subdirectory; returns their summaries by label."""
    results = {}
    wait = options.pop("wait_quiet")
    for label, what, variant in halves:
        console.print(f"[bold]{scenario.name}[/] {what}")
        sub = out / label
        sub.mkdir(parents=True, exist_ok=True)
        _quiet(console, wait)
        with target_factory(sub) as target:
            results[label] = LoadRun(variant, target, sub, console, progress, **options).execute()
    return results


def _run_dominator(
    scenario: Scenario, target_factory: TargetFactory, out: Path, console: Console, progress: bool, **options: Any
) -> dict[str, Any]:
    results = _run_pair(
        scenario,
        target_factory,
        out,
        console,
        progress,
        (
            ("without", "without the dominator client", dataclasses.replace(scenario, dominator=False)),
            ("with", "with the dominator client", dataclasses.replace(scenario, dominator=True)),
        ),
        **options,
    )
    without, with_ = results["without"]["latency_ms"], results["with"]["latency_ms"]
    summary = {
        "scenario": dataclasses.asdict(scenario),
        "target": results["with"]["target"],
        "dominator": {
            "light_p50_ms_without": without["p50"],
            "light_p50_ms_with": with_["p50"],
            "light_p99_ms_without": without["p99"],
            "light_p99_ms_with": with_["p99"],
            "p99_ratio": round(with_["p99"] / without["p99"], 3) if without["p99"] else None,
            "dominator_latency_ms": results["with"].get("latency_ms_dominator", {}),
        },
        "without": results["without"],
        "with": results["with"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    report.print_comparison(
        console,
        {"without": analysis.figures(results["without"]), "with": analysis.figures(results["with"])},
        f"{scenario.name}: light clients without / with the dominator",
        ratio=("with", "without"),
    )
    console.print(f"light clients p99: {without['p99']} ms without, {with_['p99']} ms with the dominator; results in {out}")
    return summary


def _run_coldhot(
    scenario: Scenario, target_factory: TargetFactory, out: Path, console: Console, progress: bool, **options: Any
) -> dict[str, Any]:
    results = _run_pair(
        scenario,
        target_factory,
        out,
        console,
        progress,
        (
            ("alone", "with the hot topics silent (cold topics alone)", dataclasses.replace(scenario, hot_silent=True)),
            ("beside", "with the hot topics published (cold beside hot)", dataclasses.replace(scenario, hot_silent=False)),
        ),
        **options,
    )
    alone = results["alone"]["topic_classes_ms"].get("cold", {})
    beside = results["beside"]["topic_classes_ms"].get("cold", {})
    hot = results["beside"]["topic_classes_ms"].get("hot", {})
    summary = {
        "scenario": dataclasses.asdict(scenario),
        "target": results["beside"]["target"],
        "coldhot": {
            "cold_p50_ms_alone": alone.get("p50", 0.0),
            "cold_p50_ms_beside": beside.get("p50", 0.0),
            "cold_p99_ms_alone": alone.get("p99", 0.0),
            "cold_p99_ms_beside": beside.get("p99", 0.0),
            "p99_ratio": round(beside["p99"] / alone["p99"], 3) if alone.get("p99") and beside else None,
            "hot_latency_ms": hot,
        },
        "alone": results["alone"],
        "beside": results["beside"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    report.print_comparison(
        console,
        {"alone": analysis.figures(results["alone"]), "beside": analysis.figures(results["beside"])},
        f"{scenario.name}: cold topics alone / beside a hot topic",
        ratio=("beside", "alone"),
    )
    console.print(
        f"cold topics p99: {alone.get('p99')} ms alone, {beside.get('p99')} ms beside the hot topic "
        f"(ratio {summary['coldhot']['p99_ratio']}); results in {out}"
    )
    return summary
