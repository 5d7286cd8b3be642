"""core/ must stay sans-I/O: no I/O, framework, clock or gateway import (STYLE.md pattern 1)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CORE = Path(__file__).resolve().parents[2] / "core"
FORBIDDEN = {
    "asyncio",
    "anyio",
    "trio",
    "socket",
    "select",
    "selectors",
    "ssl",
    "threading",
    "multiprocessing",
    "subprocess",
    "time",
    "datetime",
    "starlette",
    "uvicorn",
    "websockets",
    "httpx",
    "gateway",
    "io",
    "os",
    "random",
    "secrets",
    "uvloop",
}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            roots.add("__import__")
    return roots


#: native.py chooses, once at import, between the compiled modules and their sources: it reads an
#: environment variable and file times, and no engine path calls it (core/__init__.py imports it first)
ALLOWED = {"native.py": {"os"}}


def test_core_modules_import_no_io_framework_clock_or_gateway():
    modules = sorted(CORE.glob("*.py"))
    assert len(modules) >= 5
    offenders = {m.name: sorted(imported_roots(m) & (FORBIDDEN | {"__import__"}) - ALLOWED.get(m.name, set())) for m in modules}
    assert {name: bad for name, bad in offenders.items() if bad} == {}


def test_only_the_package_imports_the_build_choice():
    importers = sorted(m.name for m in CORE.glob("*.py") if "native" in m.read_text() and m.name != "native.py")
    assert importers == ["__init__.py"]


def test_the_check_catches_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\nfrom time import monotonic\nfrom . import fine\n")
    assert imported_roots(bad) & FORBIDDEN == {"asyncio", "time"}
