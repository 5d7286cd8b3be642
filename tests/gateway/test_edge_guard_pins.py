"""The HTTP edge guard (gateway/edge/netguard.py) is the one subclass of a dependency's class left: it overrides
uvicorn's httptools protocol. These tests pin what it relies on against the installed uvicorn, so an upgrade
that renames or reshapes any of it fails here, not in production."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.edge.netguard import GuardedHttpToolsProtocol

pytestmark = pytest.mark.unit

#: uvicorn's methods the guard overrides, with their parameters
OVERRIDDEN = {
    "connection_made": ["self", "transport"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_header": ["self", "name", "value"],
    "on_headers_complete": ["self"],
    "on_message_complete": ["self"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
    "connection_lost": ["self", "exc"],
}
#: uvicorn's methods the guard calls without overriding them
CALLED = [
    "_unset_keepalive_if_required",
    "send_400_response",
    "_should_upgrade",
    "handle_websocket_upgrade",
    "_unsupported_upgrade_warning",
]
#: uvicorn's per-connection state the guard reads or clears
ATTRIBUTES = ["parser", "loop", "logger", "transport", "scope", "cycle", "headers"]


def test_the_guard_overrides_exactly_the_pinned_methods_with_their_signatures() -> None:
    overrides = {name for name in vars(GuardedHttpToolsProtocol) if callable(getattr(HttpToolsProtocol, name, None))}
    assert overrides == set(OVERRIDDEN), "a new override of uvicorn's protocol: pin it here, with what it needs"
    for name, params in OVERRIDDEN.items():
        assert list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == params, name
        assert list(inspect.signature(getattr(GuardedHttpToolsProtocol, name)).parameters) == params, name


def test_what_the_guard_calls_and_reads_of_uvicorn_is_there() -> None:
    assert uvicorn.__version__ == "0.54.0", "uvicorn moved: re-read gateway/edge/netguard.py against it, then re-pin"
    for name in CALLED:
        assert callable(getattr(HttpToolsProtocol, name, None)), name
    config = Config(app=lambda *a: None)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        proto = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    finally:
        loop.close()
    state = set(vars(proto)) | {"transport", "scope", "cycle", "headers"}  # set per connection and request
    source = inspect.getsource(HttpToolsProtocol)
    for name in ATTRIBUTES:
        assert name in state and f"self.{name} =" in source, name


def test_the_websocket_protocol_is_ours_alone() -> None:
    """The WebSocket data plane imports nothing of uvicorn and silences no type check: it uses websockets'
    sans-I/O protocol through its public API, and uvicorn only hands it the upgraded connection."""
    transports = Path(__file__).resolve().parents[2] / "gateway" / "transports"
    for path in sorted(transports.glob("ws*.py")):
        source = path.read_text()
        assert "type: ignore" not in source, path.name
        for node in ast.walk(ast.parse(source)):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] == "uvicorn" for name in names), path.name
