"""Which build of the core runs: the modules mypyc compiled at install (setup.py), or the same modules as
plain Python.

The compiled ones run unless FANOUT_PURE_PYTHON is set (a profiler sees no Python frames inside them) or
a source is not the one they were compiled from: the build records a SHA-256 of each source it compiled
(`_compiled.json`, written by setup.py), and an edit or a checkout since the last build changes it (the
source wins, and `make setup` rebuilds). File times decide nothing: pip writes a wheel's `.py` files after
its `.so` files. It is all or nothing: compiled modules call each other's native classes directly.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).parent
_PACKAGE = __name__.rpartition(".")[0]
#: the suffix of an extension module built for this interpreter (".cpython-311-x86_64-linux-gnu.so")
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
#: {module: SHA-256 of the source it was compiled from}, written by the build (setup.py)
BUILD_RECORD = _HERE / "_compiled.json"


class _SourceFirst:
    """A meta path finder: the package's compiled modules are loaded from their `.py` files instead."""

    def __init__(self, names: set[str]) -> None:
        self.modules = {f"{_PACKAGE}.{name}": _HERE / f"{name}.py" for name in names}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        source = self.modules.get(fullname)
        return None if source is None else importlib.util.spec_from_file_location(fullname, source)


def _pure_requested() -> bool:
    return os.environ.get("FANOUT_PURE_PYTHON", "") not in ("", "0")


def _compiled_from() -> dict[str, str]:
    try:
        record = json.loads(BUILD_RECORD.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _stale(built: Sequence[str]) -> list[str]:
    """The built modules whose source is not the one recorded at build time (or was never recorded)."""
    record = _compiled_from()
    return sorted(name for name in built if record.get(name) != hashlib.sha256((_HERE / f"{name}.py").read_bytes()).hexdigest())


def _choose() -> tuple[bool, str]:
    """(compiled, why), installing the source-first finder when the compiled modules must not run."""
    built = {path.name[: -len(_SUFFIX)]: path for path in _HERE.glob("*" + _SUFFIX)}
    built = {name: path for name, path in built.items() if (_HERE / f"{name}.py").exists()}
    if not built:
        return False, "pure Python (not compiled at install: no C compiler, or FANOUT_PURE_PYTHON was set)"
    if _pure_requested():
        reason = "FANOUT_PURE_PYTHON is set"
    else:
        stale = _stale(sorted(built))
        if not stale:
            return True, f"compiled ({len(built)} modules, mypyc)"
        reason = f"{', '.join(stale)} changed since the build; `make setup` rebuilds"
    sys.meta_path.insert(0, _SourceFirst(set(built)))
    return False, f"pure Python ({reason})"


COMPILED, BUILD = _choose()
