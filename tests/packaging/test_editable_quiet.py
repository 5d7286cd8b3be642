"""`make setup` (and so a first `make run`) installs the checkout editable with `pip install -q -e`: nothing
of the build should print then but a real problem. setuptools' "Editable installation" note came out as a
"!!" box (issue 34, item 18): setup.py silences that note only.

The install runs on a copy of the tracked files into an empty venv, by this venv's pip (recent pips show a
build backend's warnings even with -q), with FANOUT_PURE_PYTHON=1: the compile is not what is checked here
(tests/packaging/test_wheel.py builds it), and skipping it keeps this to seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def tracked_copy(target: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def test_an_editable_install_prints_no_warning_box(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (its tracked files are copied)")
    tree = tracked_copy(tmp_path / "tree")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "FANOUT_", "PYTHON"))},
        "FANOUT_PURE_PYTHON": "1",
    }
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q", "--no-deps", "-e", str(tree)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    output = installed.stdout + installed.stderr
    assert installed.returncode == 0, output[-3000:]
    assert "!!" not in output, output


def test_the_set_up_says_what_it_does_and_how_long_before_the_quiet_install() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    # -n: print the recipe without running it; -B: as on a fresh clone, where the set-up has never run
    recipe = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), ".venv/.installed"], capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    said = next(i for i, line in enumerate(recipe) if line.startswith("echo") and "compiling the core" in line)
    installs = next(i for i, line in enumerate(recipe) if "pip install -q -e" in line)
    assert said < installs and "minutes" in " ".join(recipe[said:installs]), recipe
