"""deploy/systemd/fanout-gateway.service (issue 51): verified by systemd itself, its stop timeout covering the
drain, its hardening measured.

`systemd-analyze verify` needs no running systemd: it loads the unit with the units it refers to from a root
of the test's own (the system's unit folder copied, the venv's `gateway` stood in by an executable), so a
misspelt option or signal, a missing executable or a bad dependency fails the test."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "fanout-gateway.service"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or not SYSTEM_UNITS.is_dir(),
    reason="systemd-analyze (Debian's systemd) is not installed",
)


def settings() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root holding the system's units and the unit's ExecStart executable."""
    shutil.copytree(SYSTEM_UNITS, tmp_path / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    executable = Path(settings()["Service"]["ExecStart"].split()[0])
    stand_in = tmp_path / executable.relative_to("/")
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    (tmp_path / "etc" / "systemd" / "system").mkdir(parents=True)
    return tmp_path


def verify(root: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` of `text` installed in root's /etc/systemd/system (where it looks the unit up)."""
    installed = root / "etc" / "systemd" / "system" / UNIT.name
    installed.write_text(text)
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", str(installed)], capture_output=True, text=True, timeout=60
    )


def test_systemd_verifies_the_unit_without_a_word(root: Path) -> None:
    done = verify(root, UNIT.read_text())
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done
    # the same check on a copy with one misspelt signal speaks up: the check can fail
    assert "SIGTREM" in verify(root, UNIT.read_text().replace("KillSignal=SIGTERM", "KillSignal=SIGTREM")).stderr


def test_the_stop_timeout_covers_the_drain_and_sigterm_starts_it() -> None:
    service = settings()["Service"]
    assert service["KillSignal"] == "SIGTERM"
    # the supervisor forwards the signal to its workers itself (docs/cluster.md §5)
    assert service["KillMode"] == "mixed"
    server = tomllib.loads((ROOT / "config" / "default.toml").read_text())["server"]
    recommended_delay = 5.0  # docs/operations.md, "Drain and rolling restart"
    assert float(service["TimeoutStopSec"]) > max(server["drain_delay_s"], recommended_delay) + server["drain_timeout_s"]
    assert service["ExecStart"].split()[1:] == ["serve", "--config", "/etc/fanout-gateway/gateway.toml"]
    assert service["EnvironmentFile"] == "/etc/fanout-gateway/gateway.env"
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"  # 2: a config error


def test_the_unit_runs_unprivileged_and_hardened(root: Path) -> None:
    shutil.copy(UNIT, root / "etc" / "systemd" / "system" / UNIT.name)  # where --root looks the name up
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--no-pager", UNIT.name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    exposure = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert exposure, done.stdout[-2000:] + done.stderr[-2000:]
    # systemd's scale: 0 (locked down) to 10 (unprotected); below 2 it calls "OK"
    assert float(exposure[1]) < 2.0, done.stdout
    service = settings()["Service"]
    assert service["User"] == "fanout-gateway" and service["NoNewPrivileges"] == "yes"
