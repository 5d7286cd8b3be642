"""The layers of gateway/ (docs/architecture.md "Layers"), checked on the source: every import between two rooms
of the gateway (a folder, or a module at the top of gateway/) goes down the layer table or stays in its layer,
and no two rooms import each other. Imports under `if TYPE_CHECKING:` count too: they are the same dependency.

What may still run back up is named in `OWNED_ELSEWHERE`, with why it is there; an entry no
longer needed fails the test, so the list only shrinks."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

#: bottom to top; a room imports only rooms of its own layer or below. A room is a folder ("auth/"), a module at
#: the top of gateway/ ("hub"), or, for the one folder that holds two layers, a module of it ("centrifugo/api").
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundation",
        {
            "__init__",
            "errors",
            "close_codes",
            "config",
            "shipped_files",
            "timerwheel",
            "schema",
            "fanwrite",
            "fanwrite_py",
            "wsframes",
            "topic_view",
        },
    ),
    ("watch and guard", {"ops/", "edge/"}),
    ("who a client is", {"auth/"}),
    (
        "what the engine is told",
        {"hooks/", "presence", "topic_budget", "pending_connects", "session_tables", "tenancy", "session_store"},
    ),
    ("the engine's writer and the broker", {"broker/", "scheduler", "token_lifetimes"}),
    ("clients and topics", {"clients", "catalog", "user_commands", "control_commands"}),
    ("one connection", {"admission", "session", "session_services", "client_protocol", "commands", "transports/", "centrifugo/"}),
    ("the process", {"hub", "stats_feed"}),
    (
        "the apps",
        {
            "admin/",
            "centrifugo/api",
            "centrifugo/api_methods",
            "centrifugo/api_users",
            "centrifugo/api_requests",
            "centrifugo/context",
            "centrifugo/idempotency",
            "centrifugo/channel_glob",
            "app",
            "server",
            "cli",
            "workers/",
            "testing",
            "__main__",
        },
    ),
]

#: imports allowed to run up or round, each with why: (room, room it imports) -> the reason. None today: a new
#: entry needs a reason a reviewer accepts
OWNED_ELSEWHERE: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(GATEWAY.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """The room of `gateway.x.y`: its folder ("x/"), its own name at the top ("x"), or a module of its own."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    if not (GATEWAY / parts[0]).is_dir():
        return parts[0]
    if len(parts) > 1 and f"{parts[0]}/{parts[1]}" in LAYER_OF:
        return f"{parts[0]}/{parts[1]}"
    return f"{parts[0]}/"


LAYER_OF = {name: index for index, (_, names) in enumerate(LAYERS) for name in names}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """The gateway modules `path` imports (a `from . import x` of a module names that module), with lines."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "gateway"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "gateway":
                continue
            folder = GATEWAY.parent.joinpath(*target.split("."))
            for alias in node.names:
                if folder.is_dir() and (folder / f"{alias.name}.py").exists() or (folder / alias.name).is_dir():
                    found.append((f"{target}.{alias.name}", node.lineno))
                else:
                    found.append((target, node.lineno))
    return found


def cross_room_imports() -> list[tuple[str, int, str, str]]:
    """(importing module, line, its room, the room imported) for every import between two rooms."""
    edges = []
    for path in sorted(GATEWAY.rglob("*.py")):
        module = module_name(path)
        for target, line in imported_modules(path):
            if room(target) != room(module):
                edges.append((module, line, room(module), room(target)))
    return edges


def test_every_room_of_the_gateway_has_a_layer() -> None:
    rooms = {room(module_name(path)) for path in GATEWAY.rglob("*.py")}
    assert sorted(rooms - LAYER_OF.keys()) == [], "put each new room of gateway/ in LAYERS (and the docs' table)"
    assert sorted(LAYER_OF.keys() - rooms) == [], "a room of LAYERS that is gone"


def test_no_import_runs_up_the_layers() -> None:
    up = [
        f"{module}:{line} ({layer}) imports {target} ({LAYERS[LAYER_OF[target]][0]})"
        for module, line, layer, target in cross_room_imports()
        if LAYER_OF[target] > LAYER_OF[layer] and (layer, target) not in OWNED_ELSEWHERE
    ]
    assert up == []


def test_no_folder_and_another_room_import_each_other() -> None:
    """Two modules at the top of gateway/ in one layer may import each other (a module cycle, not a layer's);
    a folder may not be imported by what it imports."""
    imports: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, line, layer, target in cross_room_imports():
        if (layer, target) not in OWNED_ELSEWHERE:
            imports[layer, target].append(f"{module}:{line}")
    both_ways = sorted(
        f"{a} <-> {b}: {imports[a, b]} / {imports[b, a]}"
        for a, b in imports
        if (b, a) in imports and a < b and (a.endswith("/") or b.endswith("/"))
    )
    assert both_ways == []


def test_the_allowances_are_all_still_needed() -> None:
    used = {(layer, target) for _, _, layer, target in cross_room_imports()}
    assert sorted(OWNED_ELSEWHERE.keys() - used) == [], "an import fixed: remove its entry from OWNED_ELSEWHERE"


def test_the_architecture_document_shows_the_same_layers() -> None:
    text = (GATEWAY.parent / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    for name, rooms in LAYERS:
        assert name in section, f"docs/architecture.md's Layers do not name the layer {name!r}"
        # a module of a folder may be named alone in its folder's line ("`centrifugo/api` (with `context`)")
        missing = [
            r
            for r in rooms
            if r != "__init__" and f"`{r.rstrip('/')}" not in section and f"`{r.rpartition('/')[2]}`" not in section
        ]
        assert missing == [], f"docs/architecture.md's layer {name!r} does not list {missing}"
