"""The scheduler is the engine's only writer (docs/architecture.md): in gateway/, only gateway/scheduler.py
holds the core `Engine`. Everyone else reads through the scheduler's read-only view (`TopicView`) and changes
it through the scheduler's verbs, so every change comes with its wake-up.

Checked on the source, as the sans-I/O rule beside it: outside gateway/scheduler.py no module imports
`Engine`, touches an attribute named `engine`, or calls one of the engine's writing verbs on a name that says
engine. Without the import, a typed module (`mypy --strict`) has no way to hold an `Engine` at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
ENGINE = ROOT / "core" / "engine.py"
#: the one module that may hold and change the engine
WRITER = "gateway/scheduler.py"

#: the `Engine` methods that change it (core/engine.py)
WRITES = frozenset(
    {
        "create_topic",
        "restart_topic",
        "skip",
        "delete_topic",
        "reclaim",
        "resolve",
        "connect",
        "disconnect",
        "set_owner",
        "enable_fairness",
        "set_tenant",
        "subscribe",
        "unsubscribe",
        "send_direct",
        "publish",
        "release",
        "reserve",
        "tick",
        "take_space_freed",
        "mark_ready",
        "mark_idle",
        "commit",
        "ack",
        "take_committed",
        "evict",
        "rollback",
        "write_done",
        "writes_done",
        "run_cycle",
        "take_crowds",
        "attach_sink",
    }
)
#: those that only read it (what `TopicView` offers, and the scheduler's own reads)
READS = frozenset(
    {
        "topic",
        "topics",
        "topic_count",
        "has_topic",
        "topic_config",
        "client",
        "clients",
        "has_client",
        "lingering",
        "next_release",
        "has_work",
    }
)


def engine_methods() -> set[str]:
    """The public methods and properties of `Engine`, from its source."""
    tree = ast.parse(ENGINE.read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return {n.name for n in engine.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def _says_engine(node: ast.expr) -> bool:
    """`engine`, `self.engine`, `x._engine`, `core_engine`: a receiver whose last name says engine."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "engine" in name.lower()


def offences(source: str) -> list[str]:
    """What in `source` holds or writes the engine: `line: what`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append((node.lineno, ".engine"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("core", "core.engine") and node.level == 0:
            if any(alias.name == "Engine" for alias in node.names):
                found.append((node.lineno, "imports Engine"))
        elif isinstance(node, ast.Import) and any(alias.name == "core.engine" for alias in node.names):
            found.append((node.lineno, "imports core.engine"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in WRITES
            and _says_engine(node.func.value)
        ):
            found.append((node.lineno, f"calls {node.func.attr}"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_every_engine_method_is_known_as_a_write_or_a_read() -> None:
    """A new verb of the core must be sorted here, or the check below would not see it."""
    assert engine_methods() == WRITES | READS
    assert not WRITES & READS


def test_only_the_scheduler_holds_or_writes_the_engine() -> None:
    found = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name != WRITER:
            bad = offences(path.read_text())
            if bad:
                found[name] = bad
    assert found == {}


def test_the_check_catches_each_way_to_hold_or_write_the_engine() -> None:
    bad = (
        "from core import Engine, Published\n"
        "hub.scheduler.engine.topic_count\n"
        "engine.connect('c')\n"
        "self._engine.disconnect('c')\n"
        "self.scheduler.connect('c')\n"  # a verb of the scheduler: fine
        "broker.publish('t', 1)\n"
    )
    assert offences(bad) == ["1: imports Engine", "2: .engine", "3: calls connect", "4: calls disconnect"]
