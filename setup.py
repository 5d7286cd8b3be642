"""The compiled core: mypyc turns the scheduler's hot modules into C extensions at install, when a C compiler
and the Python headers are there. Without them (a warning), or with FANOUT_PURE_PYTHON=1 set, the same
modules run as plain Python (docs/architecture.md, "The compiled core"). Everything else is in
pyproject.toml."""

import os

from setuptools import setup

# The modules a cycle runs through. Not compiled: config.py (it validates untyped input at run time, which
# mypyc's type checks would turn into TypeErrors), errors.py (no hot path) and byte_ring.py (the raw TCP
# path measured slower compiled, docs/architecture.md).
COMPILED = [
    "core/client.py",
    "core/counters.py",
    "core/engine.py",
    "core/entries.py",
    "core/private.py",
    "core/ring.py",
    "core/snapshot.py",
    "core/topics.py",
]


def extensions() -> list:
    if os.environ.get("FANOUT_PURE_PYTHON", "") not in ("", "0"):
        return []
    from mypyc.build import mypycify

    modules = mypycify(COMPILED, opt_level="3")
    for module in modules:
        module.optional = True  # a failed compile warns; the modules then run as Python
    return modules


setup(ext_modules=extensions())
