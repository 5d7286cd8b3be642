"""The files the gateway ships beside its code: the default config and the pages (client library, demo,
dashboard).

In a checkout they are the top-level folders config/ and static/; an installed wheel holds the same files as
the packages `gateway.defaults` and `gateway.static` (setup.py maps the folders to them). Both are read
through importlib.resources, so an installed gateway and a checkout find the same files wherever they run
from; a checkout that was never installed (no package mapping) falls back to its own folders.
"""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]


def _shipped_file(package: str, checkout_folder: str, name: str) -> Path:
    """The file `name` of a data package, as a path on disk (a wheel installs files, never a zip)."""
    with contextlib.suppress(ModuleNotFoundError):
        found = resources.files(package).joinpath(name)  # a namespace package's files() joins to a Path too
        if isinstance(found, Path) and found.is_file():
            return found
    return _CHECKOUT / checkout_folder / name


def default_config_path() -> Path:
    """config/default.toml: the embedded default, the single source of defaults and keys."""
    return _shipped_file("gateway.defaults", "config", "default.toml")


def static_root() -> Path:
    """The folder of the shipped pages: static/ (index.html, fanout.js, fanout.d.ts, admin/)."""
    return _shipped_file("gateway.static", "static", "index.html").parent
