"""``fanout-loadtest`` (or ``python -m loadtest``): load runs against the gateway (or nginx + nchan), and the micro-benchmarks.

python -m loadtest SCENARIO [flags]          one run (starts its own gateway unless --url)
python -m loadtest compare SCENARIO [flags]  gateway vs nginx + nchan (--targets: + bare, gateway-w2), alternating
python -m loadtest depths SCENARIO [flags]   the gateway at several batch depths (--depths 1,8,auto)
python -m loadtest baseline SCENARIO [flags] the gateway vs the bare reference server (--bare-batches 1,8)
python -m loadtest SCENARIO --target bare    one run against the bare reference server (--bare-batch N)
python -m loadtest list                      the named scenarios
python -m loadtest wsbench                   WebSocket client cost: ours vs websockets' asyncio client
python -m loadtest core | rawtcp [...]       the core and raw-TCP benchmarks (their own flags)
python -m loadtest cluster [--clients N]     in-process vs Redis vs 2 workers; cross-node latency; kill -9 recovery
python -m loadtest idle-memory [--clients N] [--crowds K]  memory per idle WebSocket client, and after K crowds leave
python -m loadtest conn-objects [--clients N]  what one idle WebSocket client holds, object by object
python -m loadtest chaos [--duration S] [--faults a,b] [--seed N]  faults on 2 nodes, then the invariant
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # imported when a command needs them (the CLI starts without numpy and friends)
    from loadtest import runner
    from loadtest.scenarios import Scenario

#: subcommands owned by other modules, imported only when asked for
DELEGATED = {
    "core": "loadtest.core_bench",
    "rawtcp": "loadtest.rawtcp_bench",
    "wsbench": "loadtest.wsbench",
    "idle-memory": "loadtest.idle_memory",
    "conn-objects": "loadtest.conn_objects",
    "cluster": "loadtest.cluster_bench",
    "chaos": "loadtest.chaos",
}
#: exit status when a run saw silent loss: the one figure that is a broken promise, not a slow one
EXIT_SILENT_LOSS = 3
#: what the `loadtest` extra (pyproject.toml) brings that the runs import: a plain install of the wheel has none
EXTRA_MODULES = frozenset({"numpy", "matplotlib", "pyarrow", "rich"})
#: exit status of a command whose extra is not installed (as a usage error: nothing ran)
EXIT_MISSING_EXTRA = 2


def _run_parser(prog: str) -> argparse.ArgumentParser:
    from loadtest import scenarios

    parser = argparse.ArgumentParser(prog=prog, description="Load the fan-out gateway and measure it.")
    scenarios.add_arguments(parser)
    parser.add_argument("--out", type=Path, help="results directory (default results/SCENARIO-TIME)")
    parser.add_argument("--url", help="target a running gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--ingest", help="HOST:PORT of the running gateway's TCP ingest (with --url)")
    parser.add_argument("--admin-token", help="admin token of the running gateway (--publish-via admin)")
    parser.add_argument("--gateway-pid", type=int, help="pid of the running gateway, to measure its CPU")
    parser.add_argument(
        "--gateway-cmd",
        help="command that starts the gateway instead of 'python -m gateway' (it gets: serve --config FILE --ready-file PATH)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        help="seconds for all clients to subscribe (default 20, or 1 s per 250 clients when more)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--redis",
        choices=("single", "cluster"),
        default="single",
        help="the broker of a gateway with workers > 1: one redis-server (default), or a Redis "
        "Cluster of 3 primaries and 3 replicas, started for the run",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run, wait up to S seconds until the machine is idle (other programs skew a run on a shared machine)",
    )
    return parser


def _gateway_factory(
    args: argparse.Namespace,
    capacity: int,
    batch_depth: int | str = 1,
    linger: float = 0.0,
    *,
    shipped: bool = False,
    clients: int = 0,
    workers: int = 1,
) -> runner.TargetFactory:
    redis = getattr(args, "redis", "single")
    from loadtest.gatewayproc import GatewayProcess, shipped_max_connections
    from loadtest.target import Target

    if not args.url:
        limit = shipped_max_connections(clients) if shipped else None
        return lambda workdir: GatewayProcess(
            workdir,
            args.gateway_cmd,
            capacity,
            batch_depth,
            linger,
            shipped=shipped,
            max_connections=limit,
            workers=workers,
            redis=redis,
        )
    if shipped or workers > 1:
        print("note: --shipped / --workers are not applied to a running gateway (--url): its own config decides", file=sys.stderr)
    if batch_depth != 1 or linger:
        print(
            f"note: --batch-depth {batch_depth} / --linger {linger} are not applied to a running gateway "
            "(--url): its own topic rules decide",
            file=sys.stderr,
        )
    url = urlsplit(args.url if "://" in args.url else f"http://{args.url}")
    if not url.hostname or not url.port:
        raise SystemExit(f"--url needs a host and a port: {args.url}")
    ingest_port = None
    if args.ingest:
        host, _, port = args.ingest.rpartition(":")
        ingest_port = int(port)
        if host and host != url.hostname:
            raise SystemExit("--ingest must be on the same host as --url")
    target = Target("gateway", url.hostname, url.port, ingest_port, args.admin_token, args.gateway_pid)
    return lambda workdir: nullcontext(target)


def _batches(text: str) -> list[int]:
    """``--bare-batches``: comma-separated integers >= 1."""
    try:
        values = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bare batches must be comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("bare batches must be >= 1")
    return values


def _bare_problem(args: argparse.Namespace, scenario: Scenario) -> str:
    """Why the bare server cannot run this scenario ("" when it can): it speaks WebSocket and the TCP
    ingest only, and runs as our own subprocess."""
    if getattr(args, "bare_batch", 1) < 1:
        return "--bare-batch must be >= 1"
    if scenario.transport != "ws":
        return "the bare server speaks WebSocket only: --transport ws"
    if scenario.publish_via != "ingest":
        return "the bare server takes publishes on its TCP ingest only: --publish-via ingest"
    if args.url:
        return "the bare server is started by the load tool: --url cannot be used"
    return ""


#: ``compare --targets``: the gateway (with --workers), nginx + nchan, the bare server, the gateway with N workers
TARGET_NAMES = ("gateway", "nchan", "bare", "gateway-wN")


def _targets(text: str) -> list[str]:
    """``--targets``: comma-separated names of TARGET_NAMES, ``gateway`` first (``gateway-w2``: 2 workers)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in TARGET_NAMES[:3] and not (name.startswith("gateway-w") and name[9:].isdigit() and int(name[9:]) >= 1):
            raise argparse.ArgumentTypeError(f"unknown target {name!r}: one of gateway, nchan, bare, gateway-wN")
    if not names or names[0] != "gateway" or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("targets: gateway first, each at most once (e.g. gateway,nchan,bare)")
    return names


def _header(console: Any, scenario: Scenario, labels: list[str], url: bool) -> None:
    """What a run needs said before it starts: the shipped config's overrides, the source addresses, and
    where the open-files limit caps the clients."""
    import resource

    from loadtest.gatewayproc import CONNECTION_MARGIN, SHIPPED_MAX_CONNECTIONS, shipped_max_connections
    from loadtest.scenarios import source_addr

    n = scenario.clients
    gateways = [label for label in labels if label.startswith("gateway")]
    if gateways and scenario.shipped and not url:
        limit = shipped_max_connections(n)
        raised = (
            f"server.max_connections {SHIPPED_MAX_CONNECTIONS:,} -> {limit:,} (N={n:,} + {CONNECTION_MARGIN})"
            if limit
            else f"server.max_connections as shipped ({SHIPPED_MAX_CONNECTIONS:,} >= N={n:,} + {CONNECTION_MARGIN})"
        )
        console.print(
            f"gateway as shipped (config/default.toml); overridden: server.port, ingest.port, "
            f"rawtcp.sender_port / receiver_port = 0, server.admin_token; {raised}; per-address limits "
            "and topic rules as shipped"
        )
    workers = {label: int(label[9:]) if label.startswith("gateway-w") else scenario.workers for label in gateways}
    if any(w > 1 for w in workers.values()) and not url:
        console.print(
            "gateway workers: "
            + ", ".join(
                f"{label} server.workers={w}"
                + (" on a Redis broker started for the run (its CPU reported apart: broker cpu us/delivery)" if w > 1 else "")
                for label, w in workers.items()
            )
        )
    if scenario.source_addrs:
        k = scenario.source_addrs
        console.print(
            f"clients connect from {k:,} loopback addresses ({source_addr(0)} .. {source_addr(k - 1)}), "
            f"at most {-(-n // k):,} each (the shipped server.max_connections_per_ip is 256)"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if n >= 1000 or n + 100 > soft:
        procs = min(scenario.procs, n)
        cap = hard - 100  # the server's reserve: the gateway keeps 64 descriptors, nginx 100
        note = (
            f"open files: hard limit {hard:,} per process (each process's own; soft {soft:,} raised to it): "
            f"the server holds one per client, so N={n:,} of at most {cap:,} (hard - 100: the server's other "
            f"descriptors); each of the {procs} client processes holds {-(-n // procs):,}"
        )
        console.print(note if n <= cap else f"[bold red]{note}: N={n:,} is above what the server can hold")


def _out(args: argparse.Namespace, label: str) -> Path:
    return args.out or Path("results") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if module not in EXTRA_MODULES:
            raise
        print(
            f"fanout-loadtest: this command needs {module}, which the loadtest extra installs: "
            "pip install 'fanout-gateway[loadtest]' (in a checkout, `make setup` installs every extra)",
            file=sys.stderr,
        )
        return EXIT_MISSING_EXTRA


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command = argv[0]
    if command in DELEGATED:
        module = importlib.import_module(DELEGATED[command])
        return module.main(argv[1:]) or 0
    if command == "list":
        from loadtest.scenarios import SCENARIOS

        for s in SCENARIOS.values():
            rate = "max" if s.rate is None else f"{s.rate:g}/s"
            print(
                f"{s.name:12} {s.clients:5} clients {s.topics:4} topics {s.subs:3} subs {rate:>8} "
                f"{s.transport:8} {s.duration:g}s  {s.description}"
            )
        return 0

    from rich.console import Console

    from loadtest import runner, scenarios

    comparing = command == "compare"
    depths = command == "depths"
    baseline = command == "baseline"
    parser = _run_parser(f"python -m loadtest {command}" if comparing or depths or baseline else "python -m loadtest")
    if baseline:
        parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the gateway and the bare server")
        parser.add_argument(
            "--bare-batches",
            default=[1],
            type=_batches,
            help="comma-separated --batch values of the bare server, one target each (default 1)",
        )
        argv = argv[1:]
    elif not (comparing or depths):
        parser.add_argument(
            "--target",
            choices=("gateway", "bare"),
            default="gateway",
            help="gateway (default) or the bare reference server (loadtest/bare_server.py)",
        )
        parser.add_argument(
            "--bare-batch", type=int, default=1, help="--target bare: most messages of a topic per frame (default 1)"
        )
    if comparing:
        parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of gateway and nchan")
        parser.add_argument(
            "--targets",
            type=_targets,
            help="comma-separated targets, gateway first: gateway, "
            "nchan, bare (the bare server, batch 1), gateway-wN (the gateway with N workers on "
            "Redis); ratios are to nchan (default gateway,nchan; crowd and rooms: gateway,nchan,bare)",
        )
        argv = argv[1:]
    if depths:
        parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the depths")
        parser.add_argument(
            "--depths",
            default="1,8,auto",
            type=lambda text: [scenarios.parse_depth(d) for d in text.split(",")],
            help="comma-separated batch depths, each a positive integer or 'auto' (default 1,8,auto)",
        )
        argv = argv[1:]
    args = parser.parse_args(argv)
    try:
        scenario = scenarios.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    console = Console()
    from loadtest.scenarios import CROWD_SCENARIOS

    labels = ["gateway"]
    if comparing:
        labels = args.targets or ["gateway", "nchan", *(["bare"] if scenario.name in CROWD_SCENARIOS else [])]
    elif baseline:
        labels = ["gateway", "bare"]
    elif getattr(args, "target", "gateway") == "bare":
        labels = ["bare"]
    bare = "bare" in labels
    if bare:
        problem = _bare_problem(args, scenario)
        if problem:
            parser.error(problem)
    if scenario.storm_at is not None and labels != ["gateway"]:
        parser.error(
            "a reconnect storm (--storm-at) runs against the gateway only: nchan and the bare server have "
            "no resume from a seq (single runs, --target gateway)"
        )
    if scenario.storm_at is not None and args.url:
        parser.error("a reconnect storm needs a gateway the load tool starts: --url cannot be used")
    if args.url and any(label.startswith("gateway-w") for label in labels):
        parser.error("gateway-wN targets are started by the load tool: --url cannot be used")
    _header(console, scenario, labels, bool(args.url))

    def gateway_at(workers: int, depth: int | str = scenario.batch_depth) -> runner.TargetFactory:
        return _gateway_factory(
            args, scenario.capacity, depth, scenario.linger, shipped=scenario.shipped, clients=scenario.clients, workers=workers
        )

    factory = gateway_at(scenario.workers)
    if labels == ["bare"]:
        from loadtest.bare_server import BareServer

        batch = args.bare_batch
        factory = lambda workdir: BareServer(workdir, batch)  # noqa: E731
    connect_timeout = args.connect_timeout or max(20.0, scenario.clients / 250)
    options = {"connect_timeout": connect_timeout, "wait_quiet": args.wait_quiet}
    if comparing:
        from loadtest.bare_server import BareServer
        from loadtest.compare import compare

        others: dict[str, runner.TargetFactory] = {}
        for label in labels[1:]:
            if label == "bare":
                others[label] = lambda workdir: BareServer(workdir, 1)
            elif label.startswith("gateway-w"):
                others[label] = gateway_at(int(label[9:]))
        result = compare(
            scenario,
            factory,
            _out(args, f"compare-{scenario.name}"),
            args.rounds,
            console,
            not args.no_progress,
            others=others,
            with_nchan="nchan" in labels,
            **options,
        )
        silent = max(
            r["silent loss"] for label, figures in result["runs"].items() if label.startswith("gateway") for r in figures
        )
    elif baseline:
        from loadtest.compare import compare_baseline

        result = compare_baseline(
            scenario,
            factory,
            args.bare_batches,
            _out(args, f"baseline-{scenario.name}"),
            args.rounds,
            console,
            not args.no_progress,
            **options,
        )
        silent = max(r["silent loss"] for figures in result["runs"].values() for r in figures)
    elif depths:
        from loadtest.compare import compare_depths

        if args.url:
            parser.error("depths starts its own gateway per depth: --url cannot be used")
        for depth in args.depths:
            try:
                dataclasses.replace(scenario, batch_depth=depth).validate()
            except ValueError as exc:
                parser.error(f"--depths: {exc}")

        def factory_at(depth: int | str) -> runner.TargetFactory:
            return gateway_at(scenario.workers, depth)

        result = compare_depths(
            scenario,
            args.depths,
            factory_at,
            _out(args, f"depths-{scenario.name}"),
            args.rounds,
            console,
            not args.no_progress,
            **options,
        )
        silent = max(r["silent loss"] for figures in result["runs"].values() for r in figures)
    else:
        summary = runner.run(scenario, factory, _out(args, scenario.name), console, not args.no_progress, **options)
        parts = [summary[k] for k in runner.PAIRS if k in summary] or [summary]
        silent = max(p["loss"]["silent"] for p in parts)
        storm = summary.get("storm")
        if storm:
            _print_storm(console, storm)
            if not storm["ok"]:
                silent = max(silent, 1)
    return EXIT_SILENT_LOSS if silent else 0


def _print_storm(console: Any, storm: dict[str, Any]) -> None:
    accepts = storm["accept_per_s"]
    offered = "all at once" if accepts["offered"] is None else accepts["offered"]
    verdict = "[green]every client recovered, no gap, no duplicate" if storm["ok"] else "[bold red]FAILED"
    console.print(
        f"reconnect storm: {storm['back']:,}/{storm['clients']:,} clients back (spread {storm['spread_s']:g} s); "
        f"last caught up {storm['last_caught_up_s']} s after the storm (last subscribed again "
        f"{storm['last_back_s']} s); accepts/s offered {offered}, mean {accepts['mean']}, "
        f"peak over 1 s {accepts['peak_1s']:,}; reconnect p50/p99/max {storm['reconnect_ms']['p50']} / "
        f"{storm['reconnect_ms']['p99']} / {storm['reconnect_ms']['max']} ms; "
        f"{storm['failed_attempts']} failed attempts; replayed {storm['replayed']:,}; gaps {storm['gaps']}, "
        f"duplicates {storm['duplicates']}, since mismatches {storm['since_mismatch']}: {verdict}"
    )
    if storm["first_errors"]:
        console.print(f"[yellow]storm connect errors: {storm['first_errors']}")


if __name__ == "__main__":
    sys.exit(main())
