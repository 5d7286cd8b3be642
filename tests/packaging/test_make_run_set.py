"""`make run` installs what serving needs, not the test toolchain (hardening round 4, "a new user's first
hour": it installed `.[dev]`, Spark included, 1.1 GB, for minutes with nothing printed).

`make run` runs as written in a copy of the tracked files, with a venv of its own: it says what each phase
does before pip starts it, the gateway it starts serves, and its venv holds none of the test toolchain or the
extras (pytest, mypy, ruff, Spark, matplotlib, pyarrow); its stamp says the serving set is installed, and
`make setup` (what `make test` and `make check` depend on) then adds every extra. FANOUT_PURE_PYTHON=1 skips
the core's compile (tests/packaging/test_wheel.py builds it), so this takes the install of the dependencies
only (seconds from pip's cache)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
#: what serving does not need: the dev, loadtest and pipeline extras' main modules
NOT_FOR_SERVING = ("pytest", "mypy", "ruff", "hypothesis", "pyspark", "matplotlib", "pyarrow")

pytestmark = pytest.mark.timeout(600)


def tracked_copy(target: Path) -> Path:
    """The checkout's tracked files (git), or without git its tree less what builds and runs leave."""
    if shutil.which("git") and (ROOT / ".git").exists():
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for name in filter(None, files.decode().split("\0")):
            if (ROOT / name).is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target / name)
        return target
    shutil.copytree(
        ROOT,
        target,
        ignore=shutil.ignore_patterns(
            ".venv", "build", "dist", "*.egg-info", "*.so", "__pycache__", ".*_cache", ".hypothesis", "_compiled.json"
        ),
    )
    return target


def test_make_run_installs_the_serving_set_says_each_phase_and_serves(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    tree = tracked_copy(tmp_path / "tree")
    ports = {name: str(free_port()) for name in ("SERVER_PORT", "INGEST_PORT", "RAWTCP_SENDER_PORT", "RAWTCP_RECEIVER_PORT")}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "FANOUT_", "PYTHON", "VIRTUAL_ENV"))},
        **{f"GATEWAY_{name}": port for name, port in ports.items()},
        "FANOUT_PURE_PYTHON": "1",
    }
    log = tmp_path / "make-run.log"
    with open(log, "wb") as out:
        make = subprocess.Popen(
            ["make", "run", f"PY={sys.executable}"],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 540
        while "gateway listening on" not in log.read_text(errors="replace"):
            assert make.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)  # the gateway drains and ends, then make
            try:
                make.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(make.pid, signal.SIGKILL)
                make.wait(10)
    lines = log.read_text(errors="replace").splitlines()
    installs = [i for i, line in enumerate(lines) if line.startswith(".venv/bin/pip install")]
    assert installs, lines[:40]
    for before, i in zip([-1, *installs], installs):  # each pip run has a phase line of its own, printed first
        assert [line for line in lines[before + 1 : i] if line.startswith("[")], lines[: i + 1]
    assert any(line.startswith("[") and "compiling the core" in line for line in lines), lines[:40]
    assert any(line.startswith("Successfully installed ") for line in lines), lines[:40]  # pip shows its progress
    # what was installed: the dependencies and the gateway itself, nothing of the extras
    venv = tree / ".venv"
    found = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))",
            *NOT_FOR_SERVING,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.split() == [], found.stdout
    # the stamps: the serving set is there and current, the full set is not; `make setup` (which `make test` and
    # `make check` need) adds every extra beside it, without building the gateway again
    assert (venv / ".installed-run").exists() and not (venv / ".installed").exists()
    assert subprocess.run(["make", "-q", ".venv/.installed-run"], cwd=tree, env=env).returncode == 0
    upgrade = subprocess.run(["make", "-n", "setup"], cwd=tree, env=env, capture_output=True, text=True).stdout
    assert "pip install -r .venv/requirements-all.txt" in upgrade and "pip install -q -e" not in upgrade, upgrade
    writes = next(line for line in upgrade.splitlines() if line.endswith("> .venv/requirements-all.txt"))
    subprocess.run(writes, shell=True, cwd=tree, env=env, check=True)
    full = (venv / "requirements-all.txt").read_text().split()
    serving = (venv / "requirements-serve.txt").read_text().split()
    assert set(serving) < set(full), (serving, full)
    assert {"pytest", "mypy", "pyspark", "matplotlib", "pyarrow"} <= {line.split("==")[0] for line in full}, full
