"""The package as a user installs it: `python -m build` makes an sdist and, from it, a wheel; the wheel goes
into a fresh venv, and `gateway serve` started from another directory runs the compiled core with the
embedded default config and serves every page (issue 23: outside a checkout nothing of it worked)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import venv
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest

from build import BuildBackendException, ProjectBuilder
from tests import web

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def compiled_modules() -> int:
    """How many core modules setup.py compiles (its COMPILED list)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (listed,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "COMPILED"]
    assert isinstance(listed, ast.List)
    return len(listed.elts)


def _can_compile() -> bool:
    cc = (sysconfig.get_config_var("CC") or "").split()
    return bool(cc) and shutil.which(cc[0]) is not None and Path(sysconfig.get_paths()["include"], "Python.h").exists()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "FANOUT_PURE_PYTHON" and not k.startswith("PYTHON")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build`'s sdist and, from it, its wheel; in `checkout/`, the wheel `pip install <checkout>`
    builds from the source tree (`pip wheel`, the step of `pip install` that builds). The sdist first (it
    writes the tree's egg-info, as pip's build does), then both wheels at once: two compilers, two cores.

    What build's and pip's isolation would make for each of the three (a venv holding [build-system]'s
    requirements and nothing else) is made once and shared: the same hooks run in the same environment."""
    out = tmp_path_factory.mktemp("dist")
    build_env = tmp_path_factory.mktemp("build-env")
    venv.create(build_env)  # no pip of its own (isolation has none either): the project's pip installs into it
    python = str(build_env / "bin" / "python")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    env = {**_clean_env(), "PATH": f"{build_env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", *requires],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    hooks_output: list[str] = []

    def runner(cmd: Sequence[str], cwd: str | None = None, extra_environ: Mapping[str, str] | None = None) -> None:
        done = subprocess.run(
            cmd, cwd=cwd, env={**env, **(extra_environ or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        hooks_output.append(done.stdout)
        done.check_returncode()

    def build(source: Path, distribution: Literal["sdist", "wheel"]) -> Path:
        """As `python -m build` does: the backend's own requirements met, then its hook, in the build venv."""
        builder = ProjectBuilder(source, python_executable=python, runner=runner)
        try:
            assert not builder.check_dependencies(distribution), builder.check_dependencies(distribution)
            return Path(builder.build(distribution, out))
        except BuildBackendException as error:
            raise AssertionError((distribution, error, hooks_output[-1][-6000:] if hooks_output else "")) from None

    sdist = build(ROOT, "sdist")
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    from_checkout = subprocess.Popen(
        [sys.executable, "-m", "pip", "--python", python, "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(out / "checkout"), str(ROOT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        build(source, "wheel")
    finally:
        output, _ = from_checkout.communicate(timeout=540)
    assert from_checkout.returncode == 0, output[-6000:]
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
    # the checkout's wheel holds every file of it, the same (its compiled modules aside, and the RECORD of their
    # hashes). Not only those: an in-tree build also ships what a former build left in build/lib
    (checkout,) = (dist / "checkout").glob("*.whl")
    with zipfile.ZipFile(wheel) as ours, zipfile.ZipFile(checkout) as theirs:
        assert set(ours.namelist()) <= set(theirs.namelist()), set(ours.namelist()) - set(theirs.namelist())
        differ = [n for n in ours.namelist() if not n.endswith((".so", "/RECORD")) and ours.read(n) != theirs.read(n)]
    assert not differ, differ


def _requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return sorted(line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:"))


@pytest.fixture(scope="module")
def serving_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv both installs share: each puts its gateway in after the other's is uninstalled, onto the
    dependencies the first one brought (both wheels declare the same, checked below)."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir)  # no pip of its own: the project's pip installs into it (--python)
    return env_dir


@pytest.mark.parametrize("source", ["wheel", "checkout"])
def test_the_installed_package_serves_from_another_directory_with_the_compiled_core(
    source: str, dist: Path, serving_venv: Path, tmp_path: Path
) -> None:
    """`pip install dist/*.whl` and `pip install <checkout>` (not editable; its wheel built by the fixture)
    give the same gateway."""
    (wheel,) = (dist if source == "wheel" else dist / "checkout").glob("*.whl")
    (other,) = (dist / "checkout" if source == "wheel" else dist).glob("*.whl")
    assert _requires_dist(wheel) == _requires_dist(other)  # so the shared dependencies are this wheel's own
    env_dir = serving_venv
    python = env_dir / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "FANOUT_", "PYTHON"))}
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    removed = subprocess.run([*pip, "uninstall", "-q", "-y", "fanout-gateway"], capture_output=True, text=True, env=clean)
    assert removed.returncode == 0, removed.stderr[-3000:]
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert not tops & {p.name for p in site.iterdir()}, tops  # nothing of the other install remains
    installed = subprocess.run(
        [*pip, "install", "-q", str(wheel)], capture_output=True, text=True, timeout=400, env=clean
    )  # a PYTHONPATH would show another install
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ready = elsewhere / "ready.json"
    env = {**clean, "GATEWAY_INGEST_PORT": "0", "GATEWAY_RAWTCP_SENDER_PORT": "0", "GATEWAY_RAWTCP_RECEIVER_PORT": "0"}
    helps = {
        tool: subprocess.Popen(
            [str(env_dir / "bin" / tool), "--help"],
            cwd=elsewhere,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for tool in ("gateway", "fanout-loadtest", "fanout-pipeline")
    }  # at once: three imports, one wait
    for tool, helping in helps.items():
        _, errors = helping.communicate(timeout=60)
        assert helping.returncode == 0, (tool, errors[-2000:])
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
            assert web.get(base + path, timeout=10).status_code == 200, path
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert "no pages at" not in out
    assert (f"core: compiled ({compiled_modules()} modules, mypyc)" in out) == _can_compile(), out
    assert ("fan-out writer: compiled" in out) == _can_compile(), out
