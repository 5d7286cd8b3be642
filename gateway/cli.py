"""`gateway serve`: start the gateway on the embedded default config, with overrides."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from .config import ConfigError, load_config
from .server import start_gateway


def _run(coro, use_uvloop: bool):
    if use_uvloop:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


async def _serve(config, ready_file: str | None) -> None:
    running = await start_gateway(config)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(running.ports(), f)
        os.replace(tmp, ready_file)
    if not config.server.admin_token:
        print(f"admin token (development, loopback only): {running.admin_token}", flush=True)
    print(f"gateway listening on http://{config.server.host}:{running.http_port}", flush=True)
    try:
        await running.wait()
    finally:
        await running.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="fan-out gateway with fair batching")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--config", help="TOML file of overrides over config/default.toml")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument("--ready-file", help="write the bound ports and admin token here as JSON once listening")
    args = parser.parse_args(argv)
    overrides: dict = {}
    if args.host:
        overrides.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("server", {})["port"] = args.port
    try:
        config = load_config(args.config, overrides=overrides)
    except (ConfigError, OSError) as exc:
        print(f"gateway: config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _run(_serve(config, args.ready_file), config.server.uvloop)
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
