"""``fanout-loadtest`` (or ``python -m loadtest``): load runs against the gateway (or nginx + nchan), and the micro-benchmarks.

    python -m loadtest SCENARIO [flags]          one run (starts its own gateway unless --url)
    python -m loadtest compare SCENARIO [flags]  gateway vs nginx + nchan, alternating
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
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # imported when a command needs them (the CLI starts without numpy and friends)
    from loadtest import runner
    from loadtest.scenarios import Scenario

#: subcommands owned by other modules, imported only when asked for
DELEGATED = {"core": "loadtest.core_bench", "rawtcp": "loadtest.rawtcp_bench", "wsbench": "loadtest.wsbench",
             "idle-memory": "loadtest.idle_memory", "conn-objects": "loadtest.conn_objects",
             "cluster": "loadtest.cluster_bench",
             "chaos": "loadtest.chaos"}
#: exit status when a run saw silent loss: the one figure that is a broken promise, not a slow one
EXIT_SILENT_LOSS = 3


def _run_parser(prog: str) -> argparse.ArgumentParser:
    from loadtest import scenarios

    parser = argparse.ArgumentParser(prog=prog, description="Load the fan-out gateway and measure it.")
    scenarios.add_arguments(parser)
    parser.add_argument("--out", type=Path, help="results directory (default results/SCENARIO-TIME)")
    parser.add_argument("--url", help="target a running gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--ingest", help="HOST:PORT of the running gateway's TCP ingest (with --url)")
    parser.add_argument("--admin-token", help="admin token of the running gateway (--publish-via admin)")
    parser.add_argument("--gateway-pid", type=int, help="pid of the running gateway, to measure its CPU")
    parser.add_argument("--gateway-cmd", help="command that starts the gateway instead of "
                        "'python -m gateway' (it gets: serve --config FILE --ready-file PATH)")
    parser.add_argument("--connect-timeout", type=float, default=20.0, help="seconds for all clients to subscribe")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help="before each run, wait up to S seconds until the machine is idle (other "
                             "programs skew a run on a shared machine)")
    return parser


def _gateway_factory(args: argparse.Namespace, capacity: int, batch_depth: int | str = 1,
                     linger: float = 0.0) -> runner.TargetFactory:
    from loadtest.gatewayproc import GatewayProcess
    from loadtest.target import Target

    if not args.url:
        return lambda workdir: GatewayProcess(workdir, args.gateway_cmd, capacity, batch_depth, linger)
    if batch_depth != 1 or linger:
        print(f"note: --batch-depth {batch_depth} / --linger {linger} are not applied to a running gateway "
              "(--url): its own topic rules decide", file=sys.stderr)
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


def _out(args: argparse.Namespace, label: str) -> Path:
    return args.out or Path("results") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> int:
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
            print(f"{s.name:12} {s.clients:5} clients {s.topics:4} topics {s.subs:3} subs {rate:>8} "
                  f"{s.transport:8} {s.duration:g}s  {s.description}")
        return 0

    from rich.console import Console

    from loadtest import runner, scenarios

    comparing = command == "compare"
    depths = command == "depths"
    baseline = command == "baseline"
    parser = _run_parser(f"python -m loadtest {command}" if comparing or depths or baseline else "python -m loadtest")
    if baseline:
        parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the gateway and the bare server")
        parser.add_argument("--bare-batches", default=[1], type=_batches,
                            help="comma-separated --batch values of the bare server, one target each (default 1)")
        argv = argv[1:]
    elif not (comparing or depths):
        parser.add_argument("--target", choices=("gateway", "bare"), default="gateway",
                            help="gateway (default) or the bare reference server (loadtest/bare_server.py)")
        parser.add_argument("--bare-batch", type=int, default=1, help="--target bare: most messages of a topic "
                            "per frame (default 1)")
    if comparing:
        parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of gateway and nchan")
        argv = argv[1:]
    if depths:
        parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the depths")
        parser.add_argument("--depths", default="1,8,auto",
                            type=lambda text: [scenarios.parse_depth(d) for d in text.split(",")],
                            help="comma-separated batch depths, each a positive integer or 'auto' (default 1,8,auto)")
        argv = argv[1:]
    args = parser.parse_args(argv)
    try:
        scenario = scenarios.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    console = Console()
    bare = baseline or getattr(args, "target", "gateway") == "bare"
    if bare:
        problem = _bare_problem(args, scenario)
        if problem:
            parser.error(problem)
    factory = _gateway_factory(args, scenario.capacity, scenario.batch_depth, scenario.linger)
    if bare and not baseline:
        from loadtest.bare_server import BareServer

        batch = args.bare_batch
        factory = lambda workdir: BareServer(workdir, batch)  # noqa: E731
    options = {"connect_timeout": args.connect_timeout, "wait_quiet": args.wait_quiet}
    if comparing:
        from loadtest.compare import compare

        result = compare(scenario, factory, _out(args, f"compare-{scenario.name}"), args.rounds, console,
                         not args.no_progress, **options)
        silent = max(r["silent loss"] for r in result["runs"]["gateway"])
    elif baseline:
        from loadtest.compare import compare_baseline

        result = compare_baseline(scenario, factory, args.bare_batches, _out(args, f"baseline-{scenario.name}"),
                                  args.rounds, console, not args.no_progress, **options)
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
            return _gateway_factory(args, scenario.capacity, depth, scenario.linger)

        result = compare_depths(scenario, args.depths, factory_at,
                                _out(args, f"depths-{scenario.name}"), args.rounds, console, not args.no_progress,
                                **options)
        silent = max(r["silent loss"] for figures in result["runs"].values() for r in figures)
    else:
        summary = runner.run(scenario, factory, _out(args, scenario.name), console, not args.no_progress,
                             **options)
        parts = [summary[k] for k in runner.PAIRS if k in summary] or [summary]
        silent = max(p["loss"]["silent"] for p in parts)
    return EXIT_SILENT_LOSS if silent else 0


if __name__ == "__main__":
    sys.exit(main())
