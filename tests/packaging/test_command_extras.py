"""A plain `pip install` of the wheel brings `fanout-loadtest` and `fanout-pipeline` without their extras
(pyproject.toml: `loadtest`, `pipeline`). A command that needs one says which, with the pip command, and
exits 2, instead of a traceback or a bare "No module named ...". Each runs in a child interpreter where the
extra's module cannot be imported (None in sys.modules), as in a venv without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_without(module: str, entry: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{module!r}] = None  # `import {module}` now fails as in a venv without it
        from {entry} import main
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "module, entry, argv, extra",
    [
        ("numpy", "loadtest.__main__", ["crowd", "--help"], "loadtest"),
        ("matplotlib", "loadtest.__main__", ["crowd", "--help"], "loadtest"),
        ("rich", "loadtest.__main__", ["crowd", "--help"], "loadtest"),
        ("pyspark", "pipeline.__main__", ["feed"], "pipeline"),
    ],
)
def test_a_command_without_its_extra_names_the_extra_and_exits_2(module, entry, argv, extra) -> None:
    ran = run_without(module, entry, argv)
    assert ran.returncode == 2, (ran.stdout, ran.stderr)
    assert "Traceback" not in ran.stderr, ran.stderr
    assert f"needs {module}" in ran.stderr and f"pip install 'fanout-gateway[{extra}]'" in ran.stderr, ran.stderr
