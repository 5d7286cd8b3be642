"""The topic catalog asks a client's topic creation budget and charges it in one place, and the hub wires
its parts at construction (no callback slot filled afterwards). In-process: the real hub over fake
connections (tests/gateway/test_scheduler_router.py), no socket."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.errors import TooManyCreatedTopics
from gateway.hub import Hub
from tests.gateway.test_scheduler_router import connect, run, settle

pytestmark = pytest.mark.unit

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

#: the parts' callbacks that were once filled in after construction (a coupling the import graph cannot see)
SLOTS = frozenset(
    {
        "kick",
        "report_commits",
        "store",
        "delivery_log",
        "on_arrival",
        "on_departure",
        "proxy",
        "control_handler",
        "node_summary",
        "tracing",
    }
)


def test_a_subscribe_that_creates_a_topic_is_charged_and_one_past_the_budget_is_refused() -> None:
    async def test(hub: Hub) -> None:
        a = connect(hub, "a")
        hub.catalog.subscribe("a", "chat.first")  # creates it: charged
        await settle(lambda: bool(a.entries))
        assert a.identity.creations.created == 1
        with pytest.raises(TooManyCreatedTopics):
            hub.catalog.subscribe("a", "chat.second")
        assert not hub.topics.has_topic("chat.second")  # refused before anything was made
        assert hub.creations.refused["connection"] == 1

    run(test, limits={"max_created_topics": 1})


def test_a_publish_that_creates_a_topic_is_charged_and_one_to_a_topic_that_exists_is_not() -> None:
    async def test(hub: Hub) -> None:
        a, b = connect(hub, "a"), connect(hub, "b")
        hub.catalog.publish_reply("a", "chat.made", "hello", request_id=1)  # creates it: charged to a
        await settle(lambda: any(e["type"] == "reply" for e in a.entries))
        hub.catalog.publish_reply("b", "chat.made", "again", request_id=2)  # exists: b pays nothing
        await settle(lambda: any(e["type"] == "reply" for e in b.entries))
        assert (a.identity.creations.created, b.identity.creations.created) == (1, 0)
        with pytest.raises(TooManyCreatedTopics):
            hub.catalog.publish_reply("a", "chat.other", "no", request_id=3)
        assert not hub.topics.has_topic("chat.other")

    run(test, limits={"max_created_topics": 1})


def _late_fills(path: Path) -> list[str]:
    """Assignments to a slot outside its own object's `__init__` (the broker's one `attach_broker` call, as
    it is made, hands the scheduler its presence store and commit sink: the one sanctioned late binding)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            targets = (
                child.targets if isinstance(child, ast.Assign) else [child.target] if isinstance(child, ast.AnnAssign) else []
            )
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if not (isinstance(item, ast.Attribute) and item.attr in SLOTS):
                        continue
                    own = isinstance(item.value, ast.Name) and item.value.id == "self" and function == "__init__"
                    if not own and function != "attach_broker":
                        found.append(f"{item.lineno}: {ast.unparse(item)}")
            visit(child, name)

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_part_has_a_callback_slot_filled_after_construction() -> None:
    found = {p.relative_to(GATEWAY).as_posix(): bad for p in sorted(GATEWAY.rglob("*.py")) if (bad := _late_fills(p))}
    assert found == {}


def test_the_slot_check_catches_a_late_fill(tmp_path: Path) -> None:
    source = tmp_path / "hub.py"
    source.write_text(
        "class Hub:\n"
        "    def __init__(self, clients):\n"
        "        self.kick = clients.kick\n"  # its own, at construction: fine
        "        clients.on_arrival, clients.on_departure = 1, 2\n"
        "        self.scheduler.report_commits = self.broker.committed\n"
    )
    assert _late_fills(source) == ["4: clients.on_arrival", "4: clients.on_departure", "5: self.scheduler.report_commits"]
