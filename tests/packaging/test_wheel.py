"""The package as a user installs it: `python -m build` makes an sdist and, from it, a wheel; the wheel goes
into a fresh venv, and `gateway serve` started from another directory runs the compiled core with the
embedded default config and serves every page (issue 23: outside a checkout nothing of it worked)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def _can_compile() -> bool:
    cc = (sysconfig.get_config_var("CC") or "").split()
    return bool(cc) and shutil.which(cc[0]) is not None and Path(sysconfig.get_paths()["include"], "Python.h").exists()


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build`'s sdist and, from it, its wheel; in `checkout/`, the wheel `pip install <checkout>`
    builds from the source tree (`pip wheel`, the step of `pip install` that builds). The sdist first (it
    writes the tree's egg-info, as pip's build does), then both wheels at once: two compilers, two cores."""
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k != "FANOUT_PURE_PYTHON" and not k.startswith("PYTHON")}

    def build(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def finish(proc: subprocess.Popen[str]) -> None:
        output, _ = proc.communicate(timeout=540)
        assert proc.returncode == 0, (proc.args, output[-6000:])

    finish(build(sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(ROOT)))
    (sdist,) = out.glob("*.tar.gz")
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    from_sdist = build(sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(source))
    from_checkout = build(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out / "checkout"), str(ROOT)
    )
    for proc in (from_sdist, from_checkout):
        finish(proc)
    return out


def test_the_sdist_and_the_wheel_hold_the_config_the_pages_and_every_package(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"config/default.toml", "static/fanout.js", "static/admin/index.html", "setup.py"} <= names
    assert not any(name.endswith((".so", "_compiled.json")) for name in names)  # sources only
    files = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "gateway/defaults/default.toml",
        "gateway/static/fanout.js",
        "gateway/static/fanout.d.ts",
        "gateway/static/index.html",
        "gateway/static/favicon.ico",
        "gateway/static/admin/index.html",
        "gateway/static/admin/dashboard.js",
        "gateway/broker/redis_broker.py",
        "fanout_client/__init__.py",
        "fanout_client/ingest.py",
        "fanout_client/py.typed",
        "pipeline/log4j2.properties",
        "loadtest/nchan.conf.template",
    } <= files
    assert not any(name.startswith(("config/", "static/", "tests/")) for name in files)  # no top-level clutter
    if _can_compile():
        assert "core/_compiled.json" in files and any(n.startswith("core/engine.") and n.endswith(".so") for n in files)


@pytest.mark.parametrize("source", ["wheel", "checkout"])
def test_the_installed_package_serves_from_another_directory_with_the_compiled_core(
    source: str, dist: Path, tmp_path: Path
) -> None:
    """`pip install dist/*.whl` and `pip install <checkout>` (not editable; its wheel built by the fixture)
    give the same gateway."""
    (wheel,) = (dist if source == "wheel" else dist / "checkout").glob("*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "FANOUT_", "PYTHON"))}
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True, timeout=400, env=clean
    )  # a PYTHONPATH would show another install
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ready = elsewhere / "ready.json"
    env = {**clean, "GATEWAY_INGEST_PORT": "0", "GATEWAY_RAWTCP_SENDER_PORT": "0", "GATEWAY_RAWTCP_RECEIVER_PORT": "0"}
    for tool in ("gateway", "fanout-loadtest", "fanout-pipeline"):
        helped = subprocess.run(
            [str(env_dir / "bin" / tool), "--help"], cwd=elsewhere, capture_output=True, text=True, timeout=60, env=env
        )
        assert helped.returncode == 0, (tool, helped.stderr[-2000:])
    proc = subprocess.Popen(
        [str(env_dir / "bin" / "gateway"), "serve", "--port", "0", "--ready-file", str(ready)],
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the installed gateway did not start"
            time.sleep(0.1)
        base = f"http://127.0.0.1:{json.loads(ready.read_text())['http_port']}"
        for path in ("/", "/fanout.js", "/fanout.d.ts", "/admin/", "/healthz", "/favicon.ico"):
            assert httpx.get(base + path, timeout=10).status_code == 200, path
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert "no pages at" not in out
    assert ("core: compiled (10 modules, mypyc)" in out) == _can_compile(), out
    assert ("fan-out writer: compiled" in out) == _can_compile(), out
