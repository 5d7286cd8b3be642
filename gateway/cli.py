"""`gateway serve`: start the gateway on the embedded default config, with overrides; `gateway token`: mint
a development token; `gateway check-config`: check a config and print the values in force."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any

import core

from . import fanwrite
from .admin.operator_tools import check, describe_rules, mint_token, rules_note
from .broker.base import BrokerUnreachable
from .config import ConfigError, GatewayConfig, load_config
from .ops import logformat
from .server import start_gateway
from .workers.forward import WorkerLinks


def _run(coro: Coroutine[Any, Any, None], use_uvloop: bool) -> None:
    if use_uvloop:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    """Write `info` as JSON, readable by the owner only (it may hold the admin token), atomically."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a stale one from a crash; O_EXCL then refuses any file or symlink planted since
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


async def _serve(config: GatewayConfig, ready_file: str | None, worker: int = 0, links: WorkerLinks | None = None) -> None:
    running = await start_gateway(config, worker, links)
    generated = not config.server.admin_token
    if ready_file:
        info = running.ports()
        if generated:  # a configured token is the operator's already: no copy of it in one more file
            info["admin_token"] = running.admin_token
        write_ready_file(ready_file, info)
    if generated:  # one worker alone: with several, the supervisor generated and printed it before forking
        logformat.say(f"admin token (development, loopback only): {running.admin_token}")
    url = f"{'https' if config.server.ssl_certfile else 'http'}://{config.server.host}:{running.http_port}"
    logformat.say(f"{_speaker(links)} listening on {url}", url=url)
    try:
        await running.wait()
    finally:
        await running.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="fan-out gateway with fair batching")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--config", help="TOML file of overrides over config/default.toml")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument(
        "--ready-file", help="write the bound ports (and a generated admin token) here as JSON, mode 0600, once listening"
    )
    token = sub.add_parser("token", help="mint an HS256 token with auth.jwt_secret, iat and a random jti (development and tests)")
    token.add_argument("--sub", required=True, help="the user (the token's sub claim)")
    token.add_argument(
        "--subscribe",
        action="append",
        default=[],
        metavar="PATTERN",
        help="a topic pattern the user may subscribe to (repeat for more)",
    )
    token.add_argument(
        "--publish",
        action="append",
        default=[],
        metavar="PATTERN",
        help="a topic pattern the user may publish to (repeat for more)",
    )
    token.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS", help="lifetime (default 3600)")
    token.add_argument("--config", help="TOML file of overrides (for auth.jwt_secret and the rest)")
    check = sub.add_parser("check-config", help="check a config as `serve` would and print the values in force")
    check.add_argument("file", nargs="?", help="TOML file of overrides over config/default.toml")
    receiver = sub.add_parser(
        "trace-receiver", help="print the spans a gateway exports over OTLP/HTTP, one a line (development: docs/operations.md)"
    )
    receiver.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    receiver.add_argument("--port", type=int, default=4318, help="the port to listen on (default 4318, OTLP/HTTP's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "token":
        return _token(args)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "trace-receiver":
        from .ops.trace_receiver import receive

        return receive(args.host, args.port)
    overrides: dict[str, Any] = {}
    if args.host:
        overrides.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("server", {})["port"] = args.port
    try:
        config = load_config(args.config, overrides=overrides)
    except (ConfigError, OSError) as exc:
        print(f"gateway: config error: {exc}", file=sys.stderr)
        return 2
    # several workers: the supervisor's own lines name no worker (null in json), each worker's its own
    logformat.configure(config.server.log_format, config.server.log_level, None if config.server.workers > 1 else 0)
    _print_banner(config)
    if config.server.workers > 1:  # docs/cluster.md §5
        from .workers.supervisor import run_workers

        return run_workers(config, args.ready_file, _serve_worker, write_ready_file)
    return _serve_worker(config, args.ready_file, 0)


def _token(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        print(mint_token(config, args.sub, subscribe=args.subscribe, publish=args.publish, ttl=args.ttl))
    except (ConfigError, OSError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_config(path: str | None) -> int:
    try:
        config = load_config(path)
        effective = check(config)
    except (ConfigError, OSError) as exc:
        print(f"gateway: config error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(effective, indent=2))
    # the rules for a human: what a config's rules replaced is easy to miss in the JSON
    print("gateway: topic rules in force (the first whose pattern matches a new topic's name creates it):", file=sys.stderr)
    print("\n".join(describe_rules(config)), file=sys.stderr)
    note = rules_note(config)
    if note:
        print(f"gateway: {note}", file=sys.stderr)
    print(f"gateway: config OK ({path or 'the embedded default'}, GATEWAY_* variables applied)", file=sys.stderr)
    return 0


def _print_banner(config: GatewayConfig) -> None:
    """What runs, once, before anything starts (and before any worker is forked)."""
    note = rules_note(config)
    if note:
        logformat.say(f"gateway: {note}")
    logformat.say(f"core: {core.BUILD}")
    logformat.say(f"fan-out writer: {fanwrite.BUILD}")


def _speaker(links: WorkerLinks | None) -> str:
    """Who says a line: `gateway`, or `gateway worker N` when several workers print to the same output."""
    return "gateway" if links is None else f"gateway worker {links.index}"


def _tag_worker_logs(links: WorkerLinks | None) -> None:
    """Every log line of a worker names it (the workers share the supervisor's output)."""
    if links is not None:
        logformat.tag(links.index)


def _serve_worker(config: GatewayConfig, ready_file: str | None, worker: int, links: WorkerLinks | None = None) -> int:
    """Run one gateway until it stops; the exit status: 2 when it could not start (a config the checks before
    the start could not see, the broker unreachable), else 0 (docs/cluster.md, "Failures")."""
    _tag_worker_logs(links)
    try:
        _run(_serve(config, ready_file, worker, links), config.server.uvloop)
    except (ConfigError, BrokerUnreachable) as exc:
        logformat.say(f"{_speaker(links)}: {exc}", stream=sys.stderr, level=logging.ERROR)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
